"""A dispatcher stops though one of its helper loops lost a cancellation.

Python 3.11's ``asyncio.wait_for`` returns its call's result, not ``CancelledError``, when the
cancellation comes in the loop iteration in which the call completed (``backfill.cancelling``);
redis-py wraps every command in one, so the observe loop, in a ledger call at the stop, went
on observing, and the dispatcher, which had cancelled it once and awaited it, never stopped
(CI: a SIGTERMed worker's dispatcher "did not stop within 32 s"; a test's stop held 30 s).
The stand-in engine's load read plays the lost cancellation: the first one it gets, it
answers as if the call had completed.

Real Postgres and Redis.
"""

from __future__ import annotations

import asyncio

from backfill.config import Settings
from backfill.engine.protocol import EngineLoad
from tests.integration.standin_engine import StandInEngine, quick_dispatcher, stand_in_node

BLOCK = 16
STOP_BOUND_S = 20.0
"""Only a failure's bound: the stop takes a few hundredths of a second."""


class LosesACancellation(StandInEngine):
    """Once :attr:`held` is set, a load read waits until cancelled; the first cancellation it
    swallows and answers (3.11's ``wait_for`` race), later ones it obeys."""

    def __init__(self) -> None:
        super().__init__(blocks=64, block=BLOCK)
        self.held = False
        self.in_read = asyncio.Event()
        self.lost = 0

    async def load(self) -> EngineLoad:
        if self.held:
            self.in_read.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if self.lost:
                    raise
                self.lost += 1
        return await super().load()


def test_a_helper_that_lost_its_cancellation_does_not_hold_the_dispatchers_stop(
    settings: Settings,
) -> None:
    """Red before: the stop cancelled the observe loop once and awaited it; the loop went on
    and the dispatcher's run never returned."""
    node = "n-stop"
    engine = LosesACancellation()
    with stand_in_node(settings, node, BLOCK) as (repo, _ledger, aledger):
        dispatcher = quick_dispatcher(node, engine, repo, aledger, BLOCK, observe_interval_s=0.02)

        async def main() -> bool:
            runner = asyncio.create_task(dispatcher.run())
            try:
                engine.held = True
                await asyncio.wait_for(engine.in_read.wait(), STOP_BOUND_S)
                dispatcher.stop()
                done, _ = await asyncio.wait({runner}, timeout=STOP_BOUND_S)
                return runner in done
            finally:
                runner.cancel()
                await asyncio.wait({runner})
                await aledger.aclose()

        stopped = asyncio.run(main())
    assert engine.lost == 1, "the observe loop was not in a load read at the stop"
    assert stopped, "the dispatcher did not stop: a helper's lost cancellation held it"
