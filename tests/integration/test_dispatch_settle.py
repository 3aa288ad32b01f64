"""A node reports its items' progress to the ledger in one round trip per settle interval, not
one per item per ``settle_every_tokens`` (which was ~9 Redis calls per 300-token item: the
largest share of a fleet's Redis traffic, ``bench.fleet``), and every item's lease still
learns how far it got.

Real Postgres and Redis; the engine is the stand-in, streaming a long answer token by token.
The ledger is the real one, counting the round trips that carry settles.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

import pytest

from backfill.config import Settings
from backfill.engine.protocol import ChoiceDelta, CompletionStream, StreamChunk, Usage
from backfill.ledger import AsyncLedger
from backfill.ledger.steps import Pipelined, ScriptCall, Step
from backfill.states import ItemState
from backfill.store import Repository
from tests.integration import standin_engine as stand_in

NODE = "n-settle"
BLOCK = 16
ITEMS = 6
TOKENS = 160


class SlowStream:
    def __init__(self, tokens: int, gap_s: float) -> None:
        self.tokens, self.gap_s = tokens, gap_s

    async def __aenter__(self) -> SlowStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        for i in range(self.tokens):
            await asyncio.sleep(self.gap_s)
            last = i == self.tokens - 1
            yield StreamChunk("c", (ChoiceDelta(0, "w", "length" if last else None),), None, {})
        yield StreamChunk("c", (), Usage(5, self.tokens, 5 + self.tokens), {})

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self._chunks()


class LongAnswers(stand_in.StandInEngine):
    def answer(self, body: Mapping[str, Any]) -> CompletionStream:
        return cast(CompletionStream, SlowStream(TOKENS, 0.003))


class CountingLedger(AsyncLedger):
    """The real ledger; it counts the round trips that carry settles and what they said."""

    settle_trips = 0
    reported: dict[str, int]

    async def _carry_out(self, step: Step) -> Any:
        settles: list[ScriptCall[Any]] = []
        if isinstance(step, ScriptCall) and step.script == "settle":
            settles = [step]
        elif isinstance(step, Pipelined):
            settles = [c for c in step.calls if c.script == "settle"]
        if settles:
            self.settle_trips += 1
            for call in settles:
                lease_id, generated = call.args[1], int(call.args[3])
                self.reported[lease_id] = max(self.reported.get(lease_id, 0), generated)
        return await super()._carry_out(step)


def _submit(repo: Repository) -> str:
    return stand_in.submit_completions(repo, "t-settle", ITEMS, TOKENS)


def test_progress_is_settled_once_per_interval_for_the_whole_node(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="backfill.worker")
    engine = LongAnswers(blocks=256, block=BLOCK)
    stores = stand_in.stand_in_node(settings, NODE, BLOCK, blocks=256, async_ledger=CountingLedger)
    with stores as (repo, _, aledger):
        aledger.reported = {}
        job = _submit(repo)
        dispatcher = stand_in.quick_dispatcher(
            NODE, engine, repo, aledger, BLOCK, settle_interval_s=0.1, work_budget=None
        )
        stand_in.run_until(dispatcher, aledger, stand_in.all_succeeded(repo, job, ITEMS))

        assert repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == ITEMS
        # Every lease heard of its progress past the first settle step...
        assert len(aledger.reported) == ITEMS, aledger.reported
        assert all(g >= 32 for g in aledger.reported.values()), aledger.reported
        # ...in a handful of round trips for the node (one per 0.1 s while items run), where
        # one per item per 32 tokens took ITEMS * TOKENS / 32 = 30.
        assert aledger.settle_trips <= 12, aledger.settle_trips
        # Each attempt's start and end are events with their structured fields.
        events = [
            r.__dict__["backfill_fields"]
            for r in caplog.records
            if isinstance(r.__dict__.get("backfill_fields"), dict)
        ]
        for action in ("start", "finish_succeeded"):
            seen = [e for e in events if e["action"] == action]
            assert len(seen) == ITEMS, events
            assert all(e["node"] == NODE and e["job"] == job for e in seen), seen
            assert len({(e["item"], e["attempt"], e["lease"]) for e in seen}) == ITEMS
