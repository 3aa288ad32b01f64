"""Which attempts a node stops and what each stop means for its item
(``backfill.dispatch.stops``), and the work budget's signals as the dispatcher measures them
(``backfill.dispatch.budget``)."""

from __future__ import annotations

import pytest

from backfill.dispatch import (
    StopAction,
    StopReason,
    after_stop,
    budget_opened,
    budget_signals,
    heartbeat_stop,
    stalled,
    ttft_victims,
)
from backfill.ledger import LeaseStatus
from backfill.work_signals import InteractiveSignals
from tests.unit.dispatch_builders import budget, flight, node, prefilling_flight


@pytest.mark.parametrize(
    ("reason", "action"),
    [
        (StopReason.PREEMPTED, StopAction.PREEMPT),
        (StopReason.SHUTDOWN, StopAction.REQUEUE),
        (StopReason.LEASE_LOST, StopAction.REQUEUE),
        (StopReason.STALLED, StopAction.ENGINE_FAULT),
        (StopReason.CLAIM_LOST, StopAction.NOTHING),
        (None, StopAction.REQUEUE),
    ],
)
def test_what_a_stopped_attempt_s_item_gets(reason: StopReason | None, action: StopAction) -> None:
    assert after_stop(reason) is action


def test_every_stop_reason_has_an_action() -> None:
    for reason in StopReason:
        assert isinstance(after_stop(reason), StopAction)


def test_the_requeue_detail_is_the_reason_as_before() -> None:
    assert StopReason.LEASE_LOST.value == "lease_lost"
    assert StopReason.SHUTDOWN.value == "shutdown"


@pytest.mark.parametrize(
    ("held", "status", "reason"),
    [
        (False, None, StopReason.CLAIM_LOST),
        (False, LeaseStatus.OK, StopReason.CLAIM_LOST),
        (True, LeaseStatus.OK, None),
        (True, None, None),
        (True, LeaseStatus.PREEMPTED, StopReason.PREEMPTED),
        (True, LeaseStatus.EXPIRED, StopReason.LEASE_LOST),
        (True, LeaseStatus.FENCED, StopReason.LEASE_LOST),
    ],
)
def test_a_heartbeat_stops_an_attempt_whose_claim_or_lease_is_gone(
    held: bool, status: LeaseStatus | None, reason: StopReason | None
) -> None:
    assert heartbeat_stop(held, status) is reason


def test_an_attempt_stalls_only_when_neither_it_nor_the_engine_progressed() -> None:
    quiet = flight(1, last_chunk_at=0.0)
    chatty = flight(2, last_chunk_at=95.0)
    assert stalled([quiet, chatty], progressed_at=0.0, now=100.0, timeout_s=10.0) == [quiet]
    # The engine made progress for someone: waiting behind interactive work is no stall.
    assert stalled([quiet, chatty], progressed_at=95.0, now=100.0, timeout_s=10.0) == []


def test_ttft_victims_lose_the_least_output_and_skip_non_preemptible_ones() -> None:
    decoding = flight(1, generated=50)
    prefill = prefilling_flight(2)
    capped = prefilling_flight(3, preemptible=False)
    view = node(decoding, prefill, capped)
    assert ttft_victims(1, False, view.running) == (prefill,)
    assert ttft_victims(5, False, view.running) == (prefill, decoding)


def test_a_resumed_attempt_loses_only_this_attempt_s_output() -> None:
    resumed = flight(1, generated=80, kept=75)
    fresh = flight(2, generated=10)
    assert ttft_victims(1, False, [fresh, resumed]) == (resumed,)


def test_no_ttft_victims_while_the_engine_pauses_batch_itself() -> None:
    view = node(prefilling_flight(1))
    assert ttft_victims(3, True, view.running) == ()
    assert ttft_victims(0, False, view.running) == ()


def test_only_running_attempts_can_be_stopped() -> None:
    view = node(flight(1, stopping=True), flight(2, generating=False), flight(3))
    assert [f.item_id for f in view.running] == [3]
    assert [f.item_id for f in view.active] == [2, 3]


def test_budget_signals_count_this_worker_s_batch_beside_the_gateway_s() -> None:
    view = node(
        prefilling_flight(1, 300),
        flight(2, first_token_at=99.0),  # came while the gauge was read: may still count
        flight(3, first_token_at=10.0),
        prefilling_flight(4, 50, stopping=True),  # being stopped: not counted
    )
    seen = InteractiveSignals(waiting=2, prefilling=1, oldest_pending_since_s=5.0)
    signals = budget_signals(
        view, seen, now_s=7.0, engine_waiting=4, engine_read_at=100.0, other_batch_awaiting=3
    )
    assert (signals.interactive_waiting, signals.interactive_prefilling) == (2, 1)
    assert signals.oldest_pending_since_s == 5.0
    assert signals.now_s == 7.0
    assert signals.engine_waiting == 4
    assert signals.batch_in_flight == 3
    assert signals.batch_awaiting_first_token == 1
    assert signals.other_batch_awaiting_first_token == 3
    assert signals.batch_started_since_engine_read == 1
    assert view.load.prefilling == 300


def test_a_budget_opens_when_its_hold_lifts_or_it_grows() -> None:
    assert budget_opened(budget(8, hold=True), budget(8))
    assert budget_opened(budget(8), budget(16))
    assert not budget_opened(budget(8), budget(8, hold=True))
    assert not budget_opened(budget(16), budget(8))
