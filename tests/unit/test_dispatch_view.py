"""The dispatcher's view of its attempts (``worker.dispatch_state.Flight.view``): what the
plans are given is what the attempt holds, its lease's figures and whether it still counts."""

from __future__ import annotations

import asyncio

from backfill.dispatch import RunPlan, StopReason
from backfill.ledger import Lease
from backfill.policy import ServiceClass
from tests.unit.dispatch_builders import claimed
from worker.dispatch_state import Flight


def _flight(**fields: object) -> Flight:
    lease = Lease("ls_7", "n1", ServiceClass.BATCH, 512, 3, 0, 0, preemptible=False, deadline_ms=99)
    flight = Flight(claimed(7, attempt=2), lease, "/v1/completions", RunPlan({}, 40))
    for key, value in fields.items():
        setattr(flight, key, value)
    return flight


def test_a_flight_is_seen_with_its_lease_and_progress() -> None:
    view = _flight(prompt_tokens=100, prefill_tokens=140, generated=55, started=2.5).view()
    assert (view.item_id, view.attempt, view.lease_id) == (7, 2, "ls_7")
    assert (view.tokens, view.deadline_ms, view.preemptible) == (512, 99, False)
    assert (view.prompt_tokens, view.prefill_tokens) == (100, 140)
    assert (view.generated, view.kept, view.generated_tokens) == (55, 40, 15)
    assert view.started_at_ms == 2500
    assert view.awaiting_first_token


def test_a_flight_being_stopped_or_done_no_longer_runs() -> None:
    assert _flight(stop_reason=StopReason.PREEMPTED).view().stopping
    assert not _flight().view().generating  # no task yet

    async def running_then_done() -> tuple[bool, bool]:
        task = asyncio.create_task(asyncio.sleep(0))
        flight = _flight(task=task)
        before = flight.view().generating
        await task
        return before, flight.view().generating

    assert asyncio.run(running_then_done()) == (True, False)
