"""An attempt that breaks inside the worker ends: its item is requeued with backoff and failed
at the attempt cap, its lease released, and it leaves the flight table (before, the task died,
the item stayed ``running`` and heartbeats kept its claim and lease alive for good).

Real Postgres and Redis. The engine is a stand-in: no real engine raises an arbitrary
exception inside the worker's stream loop, which is the fault this pins down (a bug of the
worker's own, or a body only an older version stored).
"""

from __future__ import annotations

import asyncio
import json

from backfill.config import Settings
from backfill.states import ItemState
from backfill.store import Repository
from tests.integration.standin_engine import (
    StandInEngine,
    stand_in_dispatcher,
    stand_in_node,
    submit_completions,
)
from worker.dispatch import DispatchConfig

NODE = "n-fail"
BLOCK = 16  # the stand-in engine's pool: 64 blocks of 16


def _submit(repo: Repository) -> str:
    return submit_completions(repo, "t-fail", 1, 8)


def test_an_attempt_that_breaks_in_the_worker_is_retried_then_failed_and_its_lease_freed(
    settings: Settings,
) -> None:
    engine = StandInEngine(fail_after=1)
    with stand_in_node(settings, NODE, BLOCK) as (repo, ledger, aledger):
        job = _submit(repo)
        dispatcher = stand_in_dispatcher(
            DispatchConfig(node=NODE, max_attempts=3, idle_poll_s=0.05, observe_interval_s=0),
            engine,
            repo,
            aledger,
            BLOCK,
            max_sequence_tokens=512,
        )

        async def run_until_done() -> None:
            runner = asyncio.create_task(dispatcher.run())
            try:
                for _ in range(400):
                    await asyncio.sleep(0.05)
                    if repo.counted_states(job).get(ItemState.FAILED):
                        break
            finally:
                dispatcher.stop()
                await asyncio.wait_for(runner, 30)
                await aledger.aclose()

        asyncio.run(run_until_done())

        counts = repo.counted_states(job)
        assert counts.get(ItemState.FAILED) == 1, counts
        assert len(engine.streamed) == 3  # one stream per attempt, up to the cap
        (item,) = repo.items(job)
        assert item.error is not None
        assert json.loads(item.error)["code"] == "retries_exhausted"
        assert "a fault of the worker's own" in json.loads(item.error)["message"]
        assert dispatcher.in_flight == 0
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.batch_in_use == 0
        assert not snap.leases
