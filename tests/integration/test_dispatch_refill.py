"""A node refills the slack a finished item leaves as soon as its lease is released, not at its
next idle poll (issue 36: ``bench.prefix``'s Backfill side against a straight client, which
sends its next request the moment one ends).

The result writer forgets a finished attempt (waking the claim loop) and then releases its
lease; a claim loop woken in between reads the slack still held, claims nothing and sleeps.

Real Postgres and Redis; the ledger's release takes a while, as one over a busy network does;
the engine is a stand-in whose slack holds one item at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from backfill.config import Settings
from backfill.engine.protocol import ChoiceDelta, CompletionStream, StreamChunk, Usage
from backfill.ledger import AsyncLedger
from backfill.ledger import values as lv
from backfill.states import ItemState
from tests.integration import standin_engine as stand_in

BLOCK = 16
ITEMS = 4
OUT = 600
"""605 tokens a reservation: the node's batch slack (768 of 1,024) holds one."""
RELEASE_S = 0.2
IDLE_POLL_S = 20.0
"""Long, so that waiting for it cannot pass for a wake however slow the machine: a gap of
half of it is what only a missed wake explains."""


class SlowReleaseLedger(AsyncLedger):
    """The real ledger, its releases answered ``RELEASE_S`` late."""

    async def release_many(self, held: Sequence[lv.HeldLease]) -> list[lv.LeaseStatus]:
        await asyncio.sleep(RELEASE_S)
        return await super().release_many(held)


class TimedEngine(stand_in.StandInEngine):
    """Records when each stream started and ended."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spans: list[tuple[float, float]] = []

    def answer(self, body: Mapping[str, Any]) -> CompletionStream:
        started = time.monotonic()

        async def chunks() -> AsyncIterator[StreamChunk]:
            yield StreamChunk("c", (ChoiceDelta(0, "ok", None),), None, {})
            await asyncio.sleep(0.1)
            yield StreamChunk("c", (ChoiceDelta(0, "", "stop"),), None, {})
            self.spans.append((started, time.monotonic()))
            yield StreamChunk("c", (), Usage(5, 1, 6), {})

        return CompletionStream(chunks())


def test_a_released_lease_wakes_the_claim_loop(settings: Settings) -> None:
    """Red before: each next item started a whole idle poll after the one before ended (3.2-3.6
    s at a 3 s poll); now a release later (0.2 s) and a claim (0.26-0.36 s)."""
    node = "n-refill"
    engine = TimedEngine(blocks=64, block=BLOCK)
    with stand_in.stand_in_node(settings, node, BLOCK, async_ledger=SlowReleaseLedger) as (
        repo,
        ledger,
        aledger,
    ):
        ledger.register_pool(node, 64 * BLOCK, BLOCK)
        job = stand_in.submit_completions(repo, f"t-{node}", ITEMS, OUT)
        dispatcher = stand_in.quick_dispatcher(
            node, engine, repo, aledger, BLOCK, idle_poll_s=IDLE_POLL_S
        )
        stand_in.run_until(
            dispatcher, aledger, stand_in.all_succeeded(repo, job, ITEMS), polls=2400
        )
        assert repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == ITEMS, dispatcher.stats
    spans = sorted(engine.spans)
    gaps = [nxt[0] - prev[1] for prev, nxt in itertools.pairwise(spans)]
    print("gaps between one item's end and the next one's start:", [round(g, 3) for g in gaps])
    assert max(spans[i][0] - spans[i - 1][0] for i in range(1, len(spans))) > 0.1, (
        "items overlapped: the slack held more than one",
        spans,
    )
    assert max(gaps) < IDLE_POLL_S / 2, gaps
