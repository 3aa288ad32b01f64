"""Which checked items a node reserves and starts (``backfill.dispatch.starts``): the prefix
the slack holds and the work budget lets start, what each asks of the ledger, and what the
ledger's answer means for the item."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from backfill.dispatch import GiveBack, after_reserve, fit_starts, preemptible, reserve_request
from backfill.dispatch.starts import Leased
from backfill.ledger import Denial, Lease
from backfill.policy import Reason, ServiceClass
from backfill.states import ItemState
from backfill.store import Start
from tests.unit.dispatch_builders import BLOCK, budget, checked, flight, node, prefilling_flight


def _lease(tokens: int = 176) -> Lease:
    return Lease("ls_1", "n1", ServiceClass.BATCH, tokens, 7, 0, 0)


def _denial(retry_after_s: float | None) -> Denial:
    return Denial("n1", ServiceClass.BATCH, Reason.NO_SLACK, 176, 0, 0, retry_after_s)


def test_keeps_the_prefix_the_slack_holds_and_gives_back_the_rest_as_slack_full() -> None:
    items = [checked(i, prompt=100) for i in range(1, 5)]  # 176 tokens each
    plan = fit_starts(items, node(flight(9)), slack=400, block_size=BLOCK)
    assert [c.item.id for c in plan.fits] == [1, 2]
    assert [c.item.id for c in plan.rest] == [3, 4]
    assert plan.detail == "slack full"


def test_order_is_kept_a_smaller_item_behind_a_big_one_waits_its_turn() -> None:
    items = [checked(1, prompt=100), checked(2, prompt=1000), checked(3, prompt=10)]
    plan = fit_starts(items, node(flight(9)), slack=400, block_size=BLOCK)
    assert [c.item.id for c in plan.fits] == [1]


def test_an_idle_node_sends_its_first_item_to_the_ledger_even_when_it_looks_too_big() -> None:
    plan = fit_starts([checked(1, prompt=1000)], node(), slack=100, block_size=BLOCK)
    assert [c.item.id for c in plan.fits] == [1]
    busy = fit_starts([checked(1, prompt=1000)], node(flight(9)), slack=100, block_size=BLOCK)
    assert busy.fits == ()


def test_a_node_whose_last_leases_are_still_being_released_is_not_idle() -> None:
    # Its attempts have left the flight table, but their leases still hold the slack until
    # the release lands: an item that does not fit would only be denied and deferred.
    plan = fit_starts([checked(1, prompt=1000)], node(leases_held=2), slack=100, block_size=BLOCK)
    assert plan.fits == ()
    assert [c.item.id for c in plan.rest] == [1]


def test_the_work_budget_cuts_the_prefix_and_says_so() -> None:
    items = [checked(i, prompt=300) for i in range(1, 4)]
    view = node(prefilling_flight(9, 500), budget=budget(max_prefill_tokens=1024))
    plan = fit_starts(items, view, slack=10**6, block_size=BLOCK)
    assert [c.item.id for c in plan.fits] == [1]
    assert [c.item.id for c in plan.rest] == [2, 3]
    assert plan.detail == "work budget full"


def test_the_reservation_covers_every_sequence_and_carries_the_deadline() -> None:
    deadline = datetime(2030, 1, 1, tzinfo=UTC)
    item = checked(5, prompt=100, sequences=3, attempt=2, preemptions=1, deadline=deadline)
    request = reserve_request(item, "n1", max_preemptions=3, lease_ttl_s=30.0)
    assert (request.prompt_tokens, request.max_output_tokens, request.n) == (100, 64, 3)
    assert request.service_class is ServiceClass.BATCH
    assert request.owner == "n1/5/2"
    assert request.preemptible
    assert request.deadline_ms == int(deadline.timestamp() * 1000)
    assert request.ttl_ms == 30_000


def test_an_item_at_its_preemption_cap_reserves_as_non_preemptible() -> None:
    assert preemptible(2, 3)
    assert not preemptible(3, 3)
    item = checked(preemptions=3)
    assert not reserve_request(item, "n1", max_preemptions=3, lease_ttl_s=30.0).preemptible


def test_a_lease_starts_the_item() -> None:
    lease = _lease()
    assert after_reserve(lease) is lease
    assert Leased(checked(5, prompt=100), lease).start() == Start(5, 1, "ls_1", 7, 176, 100)


def test_no_slack_defers_for_as_long_as_the_ledger_says_or_a_second() -> None:
    assert after_reserve(_denial(2.5)) == GiveBack("no slack: no_slack", ItemState.DEFERRED, 2.5)
    assert after_reserve(_denial(0.0)) == GiveBack("no slack: no_slack", ItemState.DEFERRED, 1.0)


def test_a_reservation_that_can_never_be_granted_fails_the_item() -> None:
    verdict = after_reserve(_denial(None))
    assert not isinstance(verdict, (Lease, GiveBack))
    assert json.loads(verdict.error) == {"code": "reservation_refused", "message": "no_slack"}


def test_a_failed_ledger_call_gives_the_item_back_at_once() -> None:
    assert after_reserve(ConnectionError("reset")) == GiveBack("reserve failed: reset")
