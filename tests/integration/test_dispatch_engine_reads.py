"""A worker reads its engine's ``/metrics`` (rendered by vLLM's API server, CPU taken from the
engine on a CPU node) once for all the loops that need it, and while the engine's step
scheduler pauses batch itself, the work budget steps once a second instead of four times.

Measured before: the budget (every 0.25 s), the KV observer (1 s) and the stall watch each
read the page themselves, ~5 reads a second on an idle node, whatever the engine ran.

Real Postgres and Redis; the engine is the stand-in, counting the reads of its load.
"""

from __future__ import annotations

import asyncio

from backfill.config import Settings
from backfill.engine_scheduler import EngineScheduler
from backfill.work_signals import work_budget_policy
from tests.integration.standin_engine import StandInEngine, stand_in_dispatcher, stand_in_node
from worker.dispatch import DispatchConfig

BLOCK = 16
WINDOW_S = 3.0


def _reads(settings: Settings, node: str, *, scheduler: bool) -> tuple[int, int]:
    """(engine reads, budget steps) of an idle node's dispatcher over the window."""
    engine = StandInEngine(blocks=64, block=BLOCK)
    with stand_in_node(settings, node, BLOCK) as (repo, _, aledger):
        dispatcher = stand_in_dispatcher(
            DispatchConfig(
                node=node,
                work_budget=work_budget_policy(settings),
                budget_interval_s=0.25,
                budget_interval_with_scheduler_s=1.0,
                observe_interval_s=1.0,
                stall_timeout_s=2.0,
            ),
            engine,
            repo,
            aledger,
            BLOCK,
        )
        if scheduler:
            dispatcher.state.engine_scheduler = EngineScheduler("0.1.0", "0.32.0", 10)
        steps = 0
        step = dispatcher.watchers._step_budget

        async def counted_step() -> None:
            nonlocal steps
            steps += 1
            await step()

        dispatcher.watchers._step_budget = counted_step  # type: ignore[method-assign]

        async def run() -> None:
            runner = asyncio.create_task(dispatcher.run())
            try:
                await asyncio.sleep(WINDOW_S)
            finally:
                dispatcher.stop()
                await asyncio.wait_for(runner, 30)
                await aledger.aclose()

        asyncio.run(run())
    assert engine._progress == dispatcher.engine_load.reads
    return engine._progress, steps


def test_the_loops_share_one_read_of_the_engine(settings: Settings) -> None:
    reads, steps = _reads(settings, "n-reads-stock", scheduler=False)
    # Budget every 0.25 s, observer every 1 s, stall watch every 0.5 s: ~21 reads each on
    # its own; shared, the budget's fresh read serves the other two.
    assert steps >= 8, steps
    assert reads <= steps + 3, (reads, steps)


def test_the_budget_steps_once_a_second_while_the_engine_pauses_batch(
    settings: Settings,
) -> None:
    reads, steps = _reads(settings, "n-reads-sched", scheduler=True)
    assert 1 <= steps <= 4, steps
    assert reads <= 2 * steps + 3, (reads, steps)
