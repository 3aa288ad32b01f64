"""The Capacity lab's two worlds: an LRU cache, and KV reservations under the real policy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from backfill.policy import ServiceClass
from backfill_analysis.lab import (
    BLOCK_SIZE,
    MAX_REQUESTS,
    EventKind,
    KvLabConfig,
    KvTrace,
    Outcome,
    round_robin,
    simulate_kv,
    simulate_lru,
)


def test_the_stream_is_round_robin_over_the_working_set() -> None:
    assert round_robin(4, 10) == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


# -- the cache world


def test_lru_a_working_set_that_fits_misses_once_per_identifier_then_always_hits() -> None:
    trace = simulate_lru(4, 4)
    assert trace.hits == 12
    assert [s.hit for s in trace.steps] == [False] * 4 + [True] * 12
    assert trace.steps[-1].misses == 4


def test_lru_one_slot_short_of_a_round_robin_working_set_never_hits() -> None:
    trace = simulate_lru(3, 4)
    assert trace.hits == 0
    # Each miss evicts exactly the identifier that is asked for next-but-two.
    assert [s.evicted for s in trace.steps[3:7]] == [1, 2, 3, 4]


def test_lru_entries_keep_their_slot_until_evicted() -> None:
    steps = simulate_lru(3, 4).steps
    assert steps[2].slots == (1, 2, 3)
    assert steps[3].slots == (4, 2, 3)  # 4 took the slot of 1, the least recently used
    assert steps[4].slots == (4, 1, 3)


@given(st.integers(1, 16), st.integers(1, 24), st.integers(1, 200))
def test_lru_counts_add_up_and_the_cache_never_overflows(c: int, s: int, n: int) -> None:
    trace = simulate_lru(c, s, n)
    assert len(trace.steps) == n
    for step in trace.steps:
        assert step.hits + step.misses == step.index
        assert len(step.slots) == c
        held = [x for x in step.slots if x is not None]
        assert len(held) == len(set(held)) == min(c, s, len({*round_robin(s, step.index)}))
    assert trace.hits == (max(0, n - s) if s <= c else 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_slots": 0, "working_set": 4},
        {"capacity_slots": 4, "working_set": 0},
        {"capacity_slots": 4, "working_set": 4, "requests": MAX_REQUESTS + 1},
    ],
)
def test_out_of_range_controls_are_refused(kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be in"):
        simulate_lru(**kwargs)
    with pytest.raises(ValueError, match="must be in"):
        KvLabConfig(**kwargs)


# -- the engine's world


def test_kv_a_working_set_that_fits_is_admitted_once_and_then_runs_in_place() -> None:
    trace = simulate_kv(KvLabConfig(4, 4))
    assert trace.hits == 12
    assert [s.outcome for s in trace.steps[:4]] == [Outcome.ADMIT] * 4
    assert trace.steps[3].free_tokens == 0
    # Each sequence's fourth token is its last (max_tokens 4): it finishes and gives back room.
    assert trace.steps[-1].finished == 4
    assert trace.steps[-1].free_tokens == 4 * BLOCK_SIZE


def test_kv_one_slot_short_defers_the_extra_sequence_instead_of_thrashing() -> None:
    trace = simulate_kv(KvLabConfig(3, 4))
    outcomes = [s.outcome for s in trace.steps]
    assert outcomes[3] == outcomes[7] == outcomes[11] == Outcome.DEFER
    assert "exceeds the slack of 0" in trace.steps[3].reason  # the policy's own words
    assert trace.steps[3].queue == (4,)
    # The three admitted sequences keep running where LRU would score no hit at all; the
    # fourth is admitted as soon as the first finishes.
    assert trace.hits == 10
    kinds = [(e.kind, e.identifier) for e in trace.steps[12].events]
    assert kinds == [(EventKind.FINISH, 1), (EventKind.ADMIT, 4)]
    assert trace.steps[-1].deferrals == 3
    assert trace.steps[-1].preemptions == 0


def test_kv_interactive_preempts_batch_which_keeps_its_output_and_resumes() -> None:
    trace = simulate_kv(KvLabConfig(3, 4, requests=24, interactive_every=4))
    assert trace.interactive == (4,)
    step = trace.steps[3]
    assert step.outcome is Outcome.ADMIT
    assert step.service_class is ServiceClass.INTERACTIVE
    preempt, admit = step.events
    assert (preempt.kind, preempt.identifier, preempt.generated) == (EventKind.PREEMPT, 3, 1)
    assert (admit.kind, admit.identifier) == (EventKind.ADMIT, 4)
    assert step.queue == (3,)
    resumed = next(e for s in trace.steps for e in s.events if e.kind is EventKind.RESUME)
    assert (resumed.identifier, resumed.generated) == (3, 1)
    # The price of the preemption: the prompt and the kept token are prefilled again.
    assert trace.steps[-1].recomputed_tokens >= 12 + 1


def test_kv_batch_never_takes_the_interactive_reserve() -> None:
    trace = simulate_kv(KvLabConfig(4, 4, reserve_slots=1))
    assert trace.reserve_tokens == BLOCK_SIZE
    assert trace.steps[3].outcome is Outcome.DEFER
    assert max(s.batch_tokens for s in trace.steps) == 3 * BLOCK_SIZE


def test_kv_a_sequence_larger_than_the_pool_is_rejected_not_queued() -> None:
    trace = simulate_kv(KvLabConfig(2, 2, prompt_tokens=40, output_tokens=4))
    assert trace.sequence_tokens == 3 * BLOCK_SIZE
    assert {s.outcome for s in trace.steps} == {Outcome.REJECT}
    assert "larger than" in trace.steps[0].reason
    assert all(not s.queue for s in trace.steps)


def _assert_no_overcommit_and_no_silent_eviction(trace: KvTrace) -> None:
    kept: dict[int, int] = {}  # preempted sequence -> output tokens it kept
    before: set[int] = set()
    for step in trace.steps:
        # Never over-committed: the ledger's sums and the block picture agree and fit.
        held = step.interactive_tokens + step.batch_tokens
        assert held + step.free_tokens == trace.capacity_tokens
        assert step.free_tokens >= 0
        assert sum(x is not None for x in step.slots) * BLOCK_SIZE == held
        assert step.batch_tokens <= trace.capacity_tokens - trace.reserve_tokens
        resident = {x for x in step.slots if x is not None}
        assert not resident & set(step.queue)
        kinds = {(e.kind, e.identifier) for e in step.events}
        # Whatever left the pool finished or was preempted: nothing is evicted silently.
        for gone in before - resident:
            assert (EventKind.FINISH, gone) in kinds or (EventKind.PREEMPT, gone) in kinds
        for event in step.events:
            if event.kind is EventKind.PREEMPT:
                assert event.service_class is ServiceClass.BATCH
                kept[event.identifier] = event.generated
            elif event.kind is EventKind.RESUME:
                # Progress is kept: the resumed sequence starts from what it had made.
                assert event.generated == kept.pop(event.identifier)
            elif event.kind is EventKind.ADMIT:
                assert event.identifier not in kept
                assert event.generated == 0
            elif event.kind is EventKind.FINISH:
                assert event.generated == trace.config.output_tokens
        # A preempted sequence waits in the queue until it resumes.
        assert set(kept) <= set(step.queue)
        before = resident


@settings(max_examples=150, deadline=None)
@given(
    c=st.integers(1, 12),
    s=st.integers(1, 16),
    n=st.integers(1, 160),
    prompt=st.integers(0, 40),
    output=st.integers(1, 12),
    every=st.integers(0, 4),
    reserve=st.integers(0, 3),
    cap=st.integers(0, 3),
)
def test_kv_never_overcommits_and_never_evicts_without_preemption_or_deferral(
    c: int, s: int, n: int, prompt: int, output: int, every: int, reserve: int, cap: int
) -> None:
    config = KvLabConfig(c, s, n, prompt, output, every, min(reserve, c), max_preemptions=cap)
    trace = simulate_kv(config)
    assert len(trace.steps) == n
    _assert_no_overcommit_and_no_silent_eviction(trace)
    last = trace.steps[-1]
    counted = last.hits + last.admits + last.resumes + last.deferrals + last.rejections
    assert counted >= n  # admissions from the queue add to the requests' own outcomes


def test_kv_the_longest_stream_is_quick_and_deterministic() -> None:
    config = KvLabConfig(64, 256, MAX_REQUESTS, interactive_every=3, reserve_slots=8)
    first = simulate_kv(config)
    assert first == simulate_kv(config)
    _assert_no_overcommit_and_no_silent_eviction(first)
