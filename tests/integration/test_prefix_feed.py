"""A node feeds a shared-prefix job to its engine as fast as a straight client would (issue 36,
``bench.prefix``'s straight-client ratio): once the prefix is cached, the work budget's
prefill room is charged what the engine computes of each item (its own tokens), not its whole
prompt.

Real Postgres and Redis; the engine is the prefix tests' stand-in (one word a token), whose
prefill takes a while.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest

from backfill.config import Settings
from backfill.engine.protocol import CompletionStream, StreamChunk
from backfill.states import ItemState
from backfill.work_budget import WorkBudgetPolicy
from tests.integration.standin_engine import all_succeeded, run_until, stand_in_node
from tests.integration.test_dispatch_prefixes import (
    BLOCK,
    ITEMS,
    PrefillingEngine,
    _submit,
    prefix_dispatcher,
)
from worker import dispatch_prefixes
from worker.dispatch import DispatchConfig

FINDER_POLL_S = 30.0
WHOLE_PROMPT = 71
"""The stand-in's prompts: a 64-word instruction (four blocks) and seven words of their own."""


class PrefillCountingEngine(PrefillingEngine):
    """Records how many streams were in prefill (started, no first token yet) at once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefilling = self.most_prefilling = 0

    def answer(self, body: Mapping[str, Any]) -> CompletionStream:
        inner = super().answer(body)
        self.prefilling += 1
        self.most_prefilling = max(self.most_prefilling, self.prefilling)

        async def chunks() -> AsyncIterator[StreamChunk]:
            first = True
            try:
                async with inner:
                    async for chunk in inner:
                        if first:
                            first = False
                            self.prefilling -= 1
                        yield chunk
            finally:
                if first:
                    self.prefilling -= 1

        return CompletionStream(chunks())


def test_leaning_items_are_charged_only_their_own_tokens_against_the_prefill_room(
    settings: Settings,
) -> None:
    """A prefill room of three whole prompts. Red before: each leaning item was charged its
    whole prompt (71 tokens), so three at most prefilled at once, and the group started in
    waves of three, one prefill apart, though the engine computes 7 tokens of each."""
    node = "n-feed"
    engine = PrefillCountingEngine(prefill_s=0.3, blocks=64, block=BLOCK, hold_s=0.3)
    room = 3 * WHOLE_PROMPT
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        ledger.register_pool(node, 64 * BLOCK, BLOCK)
        job = _submit(repo, f"t-{node}")
        dispatcher = prefix_dispatcher(
            DispatchConfig(
                node=node,
                idle_poll_s=0.05,
                observe_interval_s=0.1,
                prefix_caching=True,
                work_budget=WorkBudgetPolicy(floor_prefill_tokens=1, ceiling_prefill_tokens=room),
            ),
            engine,
            repo,
            aledger,
        )
        started = time.monotonic()
        run_until(dispatcher, aledger, all_succeeded(repo, job, ITEMS), polls=2000)
        seconds = time.monotonic() - started
        stats = dispatcher.stats
        assert repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == ITEMS, stats
        assert stats.reservation_violations == 0, stats
        assert stats.over_reserved_samples == 0, stats
    print(f"most in prefill at once: {engine.most_prefilling}; {seconds:.2f} s; {stats}")
    assert engine.most_prefilling > 3, engine.most_prefilling


class CountCallsEngine(PrefillingEngine):
    """Records the prompt counts asked of it (``tokenize``, the claim's count; the prefix
    pass asks ``tokenize_ids``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.counts_asked = 0

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        self.counts_asked += 1
        return await super().tokenize(body, model)


def test_a_new_job_waits_a_claim_poll_for_its_pass_and_its_items_are_not_counted_twice(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job goes in progress while the node is idle. Red before: the prefix finder looked
    for a job every 2 s whatever the claims found, so the first item reached the engine ~2 s
    after the job went in progress (the claim loop then waited its own poll after the pass),
    and each item's prompt was counted again at its claim (24 counts), though the pass had
    just asked the engine for its token ids."""
    # The finder's own poll made long, so that only a wake explains a start within a third of
    # it, however slow the machine.
    monkeypatch.setattr(dispatch_prefixes, "PREFIX_POLL_S", FINDER_POLL_S)
    node = "n-wake"
    engine = CountCallsEngine(prefill_s=0.05, blocks=64, block=BLOCK, hold_s=0.1)
    submitted: list[float] = []
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        ledger.register_pool(node, 64 * BLOCK, BLOCK)
        dispatcher = prefix_dispatcher(
            DispatchConfig(
                node=node, idle_poll_s=0.25, observe_interval_s=0.1, prefix_caching=True
            ),
            engine,
            repo,
            aledger,
        )
        polls = [0]
        job: list[str] = []

        def each() -> None:
            polls[0] += 1
            if polls[0] == 6:  # 0.3 s in: the finder has looked once and found nothing
                submitted.append(time.monotonic())
                job.append(_submit(repo, f"t-{node}"))

        run_until(
            dispatcher,
            aledger,
            lambda: (
                bool(job) and repo.stats.counted_states(job[0]).get(ItemState.SUCCEEDED) == ITEMS
            ),
            polls=2000,
            each=each,
        )
        assert repo.stats.counted_states(job[0]).get(ItemState.SUCCEEDED) == ITEMS, dispatcher.stats
        assert dispatcher.stats.reservation_violations == 0, dispatcher.stats
    waited = min(engine.started) - submitted[0]
    print(
        f"first start {waited:.3f} s after the job went in progress; {engine.counts_asked} counts"
    )
    assert waited < FINDER_POLL_S / 3, waited  # before: the finder's poll, less the 0.3 s
    assert engine.counts_asked == 0, engine.counts_asked
