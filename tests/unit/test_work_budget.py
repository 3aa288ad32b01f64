"""The batch work budget controller (``backfill.work_budget``): it shrinks while interactive
waits, holds new prefills while interactive prefills, grows back when quiet, stays within its
floor and ceiling, preempts when a TTFT target would be missed, and says why."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from backfill.policy import ServiceClass
from backfill.work_budget import (
    BudgetReason,
    BudgetStep,
    WorkBudget,
    WorkBudgetPolicy,
    WorkSignals,
    admissible,
    budget_victims,
    describe,
    step,
)

POLICY = WorkBudgetPolicy(
    ttft_target_s=1.0,
    floor_seqs=2,
    ceiling_seqs=64,
    floor_prefill_tokens=256,
    ceiling_prefill_tokens=8192,
    decrease_factor=0.5,
    increase_seqs=8,
    increase_prefill_tokens=1024,
    quiet_s=2.0,
    decrease_interval_s=0.5,
)


def run(budget: WorkBudget, *signals: WorkSignals) -> WorkBudget:
    for s in signals:
        budget = step(budget, s, POLICY).budget
    return budget


def from_start(signals: WorkSignals) -> BudgetStep:
    """The first step from the initial budget (the ceiling) on ``signals``."""
    return step(WorkBudget.initial(POLICY), signals, POLICY)


def test_starts_at_the_ceiling() -> None:
    b = WorkBudget.initial(POLICY)
    assert (b.max_seqs, b.max_prefill_tokens, b.hold) == (64, 8192, False)
    assert b.code is BudgetReason.START


def test_shrinks_and_holds_while_interactive_waits_at_the_gateway() -> None:
    s = from_start(WorkSignals(now_s=10.0, interactive_waiting=2, oldest_pending_since_s=9.9))
    assert s.code is BudgetReason.INTERACTIVE_WAITING
    assert s.changed
    assert s.budget.hold
    assert (s.budget.max_seqs, s.budget.max_prefill_tokens) == (32, 4096)
    assert s.budget.code is BudgetReason.INTERACTIVE_WAITING
    assert "shrank to 32 sequences" in s.reason
    assert "2 interactive request(s) wait" in s.reason
    assert s.preempt == 0


def test_engine_queue_beyond_batchs_own_counts_as_interactive_waiting() -> None:
    # Three waiting in the engine, but batch has three items without a first token: those
    # could be all of them, so no pressure.
    own = WorkSignals(now_s=1.0, engine_waiting=3, batch_awaiting_first_token=3)
    assert from_start(own).code is BudgetReason.STEADY
    other = WorkSignals(now_s=1.0, engine_waiting=5, batch_awaiting_first_token=3)
    s = from_start(other)
    assert s.code is BudgetReason.INTERACTIVE_WAITING
    assert s.budget.max_seqs == 32
    assert "2 in the engine's queue" in s.reason


def test_other_workers_batch_in_the_shared_engine_queue_is_not_interactive() -> None:
    # Two workers on one node share the engine's queue: six waiting, two this worker's and
    # four the other's. None is interactive; reading them as such collapsed both budgets.
    both = WorkSignals(
        now_s=1.0,
        engine_waiting=6,
        batch_in_flight=8,
        batch_awaiting_first_token=2,
        other_batch_awaiting_first_token=4,
    )
    assert both.engine_other_waiting == 0
    assert from_start(both).code is BudgetReason.STEADY
    # One more in the queue than all batch together: interactive, beside batch prefills.
    more = replace(both, engine_waiting=7)
    s = from_start(more)
    assert s.code is BudgetReason.INTERACTIVE_WAITING
    assert "1 in the engine's queue beside 6 batch prefill(s)" in s.reason


def test_batch_that_got_its_first_token_since_the_gauge_was_read_is_not_interactive() -> None:
    # Batch alone, measured: the engine's gauge said 23 waiting while the worker counted 21
    # of its own awaiting a first token; the other 2 had just got theirs. Read as interactive
    # waiting, it halved the budget and held new prefills with no interactive traffic at all.
    raced = WorkSignals(
        now_s=1.0,
        engine_waiting=23,
        batch_in_flight=50,
        batch_awaiting_first_token=21,
        batch_started_since_engine_read=2,
    )
    assert raced.engine_other_waiting == 0
    assert from_start(raced).code is BudgetReason.STEADY
    # One more than that is interactive.
    s = from_start(replace(raced, engine_waiting=24))
    assert s.code is BudgetReason.INTERACTIVE_WAITING
    assert "1 in the engine's queue" in s.reason


def test_a_worker_preempts_only_its_own_prefills_at_risk() -> None:
    s = from_start(
        WorkSignals(
            now_s=10.0,
            interactive_prefilling=1,
            oldest_pending_since_s=9.4,
            batch_in_flight=5,
            batch_awaiting_first_token=2,
            other_batch_awaiting_first_token=7,
        )
    )
    assert s.code is BudgetReason.TTFT_AT_RISK
    assert s.preempt == 2


def test_one_decrease_per_interval_for_a_persisting_signal() -> None:
    b = WorkBudget.initial(POLICY)
    waiting = [
        WorkSignals(now_s=t, interactive_waiting=1, oldest_pending_since_s=t - 0.1)
        for t in (10.0, 10.2, 10.4, 10.5)
    ]
    sizes = []
    for s in waiting:
        b = step(b, s, POLICY).budget
        sizes.append(b.max_seqs)
    assert sizes == [32, 32, 32, 16]


def test_never_below_the_floor() -> None:
    b = WorkBudget.initial(POLICY)
    for i in range(40):
        b = step(
            b,
            WorkSignals(now_s=float(i), interactive_waiting=1, oldest_pending_since_s=float(i)),
            POLICY,
        ).budget
        assert b.max_seqs >= POLICY.floor_seqs
        assert b.max_prefill_tokens >= POLICY.floor_prefill_tokens
    assert (b.max_seqs, b.max_prefill_tokens) == (2, 256)
    s = step(
        b, WorkSignals(now_s=100.0, interactive_waiting=1, oldest_pending_since_s=100.0), POLICY
    )
    assert not s.changed
    assert s.budget.hold


def test_interactive_prefilling_on_target_neither_shrinks_nor_holds_batch() -> None:
    # A steady interactive stream whose TTFTs are on target is not batch's doing: batch keeps
    # its budget and may start prefills within it (a standing hold starved it on a busy node).
    s = from_start(WorkSignals(now_s=5.0, interactive_prefilling=1, oldest_pending_since_s=4.9))
    assert s.code is BudgetReason.INTERACTIVE_PREFILL
    assert not s.budget.hold
    assert not s.changed
    assert s.budget.max_seqs == 64
    assert admissible(s.budget, 0, 0, [10]) == 1
    assert "TTFT on target" in s.reason


def test_new_prefills_are_held_while_interactive_is_pending_soon_after_a_shrink() -> None:
    slow = from_start(WorkSignals(now_s=10.0, ttfts=((9.9, 0.95),))).budget
    assert slow.max_seqs == 32
    busy = step(
        slow, WorkSignals(now_s=11.0, interactive_prefilling=1, oldest_pending_since_s=10.9), POLICY
    )
    assert busy.code is BudgetReason.INTERACTIVE_PREFILL
    assert busy.budget.hold
    assert "held after a recent shrink" in busy.reason
    assert admissible(busy.budget, 0, 0, [10]) == 0
    later = step(
        busy.budget,
        WorkSignals(now_s=12.5, interactive_prefilling=1, oldest_pending_since_s=12.4),
        POLICY,
    )
    assert not later.budget.hold, "the hold lapses quiet_s after the shrink signal"


def test_interactive_queued_behind_interactive_is_not_batchs_doing() -> None:
    # Two interactive requests in the engine's queue, no batch prefill under way: they wait
    # for an interactive prefill, so the budget keeps its size.
    behind = from_start(
        WorkSignals(
            now_s=3.0,
            engine_waiting=2,
            interactive_prefilling=1,
            oldest_pending_since_s=2.8,
            batch_in_flight=10,
        )
    )
    assert behind.code is BudgetReason.INTERACTIVE_PREFILL
    assert not behind.changed
    # The same queue while batch prefills are under way: batch competes, so it shrinks.
    beside = from_start(
        WorkSignals(
            now_s=3.0,
            engine_waiting=4,
            interactive_prefilling=1,
            oldest_pending_since_s=2.8,
            batch_in_flight=10,
            batch_awaiting_first_token=2,
        )
    )
    assert beside.code is BudgetReason.INTERACTIVE_WAITING
    assert beside.budget.max_seqs == 32
    assert beside.budget.hold
    assert "beside 2 batch prefill(s)" in beside.reason


def test_grows_while_interactive_is_busy_once_ttfts_are_back_on_target() -> None:
    b = run(
        WorkBudget.initial(POLICY),
        WorkSignals(now_s=0.0, interactive_waiting=1, oldest_pending_since_s=0.0),
        WorkSignals(now_s=0.5, interactive_waiting=1, oldest_pending_since_s=0.0),
    )
    assert b.max_seqs == 16
    busy = [
        WorkSignals(
            now_s=t,
            interactive_prefilling=1,
            oldest_pending_since_s=t - 0.1,
            ttfts=((t - 0.05, 0.3),),
        )
        for t in (1.0, 2.0, 2.5, 3.0)
    ]
    sizes = []
    for s in busy:
        st = step(b, s, POLICY)
        b = st.budget
        sizes.append(b.max_seqs)
    # Held at 16 until quiet_s (2 s) after the last shrink signal at 0.5 s, then additive.
    assert sizes == [16, 16, 24, 32]
    assert st.code is BudgetReason.INTERACTIVE_PREFILL
    assert "grew to 32 sequences" in b.reason


def test_grows_back_by_steps_once_quiet_for_long_enough() -> None:
    b = run(
        WorkBudget.initial(POLICY),
        WorkSignals(now_s=0.0, interactive_waiting=1, oldest_pending_since_s=0.0),
        WorkSignals(now_s=0.5, interactive_waiting=1, oldest_pending_since_s=0.0),
        WorkSignals(now_s=1.0, interactive_waiting=1, oldest_pending_since_s=0.0),
    )
    assert b.max_seqs == 8
    assert b.hold
    quiet = step(b, WorkSignals(now_s=1.5), POLICY)
    assert quiet.code is BudgetReason.STEADY
    assert not quiet.changed
    assert not quiet.budget.hold, "the hold ends as soon as nothing waits or prefills"
    assert "0.5 s since the last shrink signal of the 2 s needed" in quiet.reason
    grown = step(quiet.budget, WorkSignals(now_s=3.0), POLICY)
    assert grown.code is BudgetReason.QUIET
    assert grown.changed
    assert grown.budget.max_seqs == 16
    assert grown.budget.code is BudgetReason.QUIET
    assert "grew to 16 sequences" in grown.budget.reason
    b = grown.budget
    for t in range(4, 40):
        b = step(b, WorkSignals(now_s=float(t)), POLICY).budget
    assert (b.max_seqs, b.max_prefill_tokens) == (64, 8192), "back at the ceiling, no further"


def test_a_ttft_near_the_target_shrinks_once_per_measurement() -> None:
    slow = ((9.5, 0.9),)  # over 80% of the 1 s target
    s = from_start(WorkSignals(now_s=10.0, ttfts=slow))
    assert s.code is BudgetReason.TTFT_NEAR_TARGET
    assert s.budget.max_seqs == 32
    assert not s.budget.hold
    # The same measurement seen again (it stays in the gateway's window) is not new.
    again = step(s.budget, WorkSignals(now_s=11.0, ttfts=slow), POLICY)
    assert again.code is not BudgetReason.TTFT_NEAR_TARGET
    assert again.budget.max_seqs == 32
    fast = step(s.budget, WorkSignals(now_s=11.0, ttfts=((10.8, 0.2),)), POLICY)
    assert fast.code is BudgetReason.STEADY


def test_preempts_when_a_pending_request_would_miss_its_target() -> None:
    s = from_start(
        WorkSignals(
            now_s=10.0,
            interactive_prefilling=1,
            oldest_pending_since_s=9.4,
            batch_in_flight=40,
            batch_awaiting_first_token=3,
        )
    )
    assert s.code is BudgetReason.TTFT_AT_RISK
    assert s.budget.hold
    assert s.budget.max_seqs == 32
    # Half the target spent: every batch prefill still going, decoding batch keeps running.
    assert s.preempt == 3
    assert "waited 0.60 s" in s.reason
    assert "preempting 3 batch sequence(s)" in s.reason
    # The target itself spent: batch over the shrunken budget (40 -> 32) goes too.
    late = from_start(
        WorkSignals(
            now_s=10.0,
            interactive_waiting=1,
            oldest_pending_since_s=8.9,
            batch_in_flight=40,
            batch_awaiting_first_token=3,
        )
    )
    assert late.preempt == 8
    few = from_start(
        WorkSignals(
            now_s=10.0,
            interactive_waiting=1,
            oldest_pending_since_s=8.9,
            batch_in_flight=5,
            batch_awaiting_first_token=3,
        )
    )
    assert few.preempt == 3
    # Nothing of batch's running: nothing to preempt, and no shrink for interactive overload
    # beyond the wait itself.
    alone = from_start(
        WorkSignals(now_s=10.0, interactive_prefilling=2, oldest_pending_since_s=8.9)
    )
    assert alone.code is BudgetReason.INTERACTIVE_PREFILL
    assert alone.preempt == 0


def test_no_preemption_before_the_risk_threshold() -> None:
    s = from_start(
        WorkSignals(
            now_s=10.0,
            interactive_waiting=1,
            oldest_pending_since_s=9.7,
            batch_in_flight=60,
            batch_awaiting_first_token=10,
        )
    )
    assert s.code is BudgetReason.INTERACTIVE_WAITING
    assert s.preempt == 0


def test_admissible_respects_sequences_and_prefill_tokens() -> None:
    b = WorkBudget(max_seqs=4, max_prefill_tokens=1000)
    assert admissible(b, 0, 0, [300, 300, 300, 300]) == 3
    assert admissible(b, 3, 0, [10, 10]) == 1
    assert admissible(b, 0, 900, [200]) == 0
    # A prompt larger than the whole prefill budget runs alone rather than never.
    assert admissible(b, 0, 0, [5000, 10]) == 1
    assert admissible(b, 1, 5000, [10]) == 0


@dataclass(frozen=True)
class FakeLease:
    lease_id: str
    generated_tokens: int
    started_at_ms: int
    service_class: ServiceClass = ServiceClass.BATCH
    tokens: int = 256
    deadline_ms: int | None = None
    preemptible: bool = True


def test_victims_are_prefills_first_then_least_output_and_never_capped_ones() -> None:
    leases = [
        FakeLease("decoding", 40, 1),
        FakeLease("old-prefill", 0, 2),
        FakeLease("new-prefill", 0, 3),
        FakeLease("capped", 0, 4, preemptible=False),
        FakeLease("interactive", 0, 5, service_class=ServiceClass.INTERACTIVE),
    ]
    assert [v.lease_id for v in budget_victims(leases, 2)] == ["new-prefill", "old-prefill"]
    assert [v.lease_id for v in budget_victims(leases, 9)] == [
        "new-prefill",
        "old-prefill",
        "decoding",
    ]
    assert budget_victims(leases, 0) == ()


def test_describe_says_the_budget_and_why() -> None:
    s = from_start(WorkSignals(now_s=1.0, interactive_waiting=1, oldest_pending_since_s=1.0))
    text = describe(s.budget)
    assert "32 sequences / 4096 prefill tokens, new prefills held" in text
    assert "interactive_waiting" in text


@pytest.mark.parametrize(
    "bad",
    [
        {"ttft_target_s": 0},
        {"floor_seqs": 0},
        {"floor_seqs": 10, "ceiling_seqs": 5},
        {"decrease_factor": 1.0},
        {"increase_seqs": 0},
        {"preempt_at_fraction": 0},
    ],
)
def test_policy_refuses_nonsense(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=r"must|need"):
        WorkBudgetPolicy(**bad)  # type: ignore[arg-type]
