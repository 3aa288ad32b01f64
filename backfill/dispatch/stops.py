"""Which attempts a node stops, and what stopping one means for its item.

An attempt is stopped for a :class:`StopReason`: the ledger preempted its lease (a notice, a
heartbeat, or the work budget protecting an interactive TTFT), its lease or its claim was
lost, its engine hung (:func:`stalled`), or the worker shuts down. :func:`after_stop` says
what the item gets for each.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum, StrEnum
from typing import TypeVar

from backfill.dispatch.view import FlightView
from backfill.ledger import LeaseStatus
from backfill.policy import VictimCandidate
from backfill.work_budget import budget_victims


class StopReason(StrEnum):
    """Why the dispatcher stopped an attempt (the value is the requeue's detail)."""

    PREEMPTED = "preempted"
    """Interactive traffic needed the room: the ledger preempted the lease, or the work
    budget did to keep an interactive TTFT target."""
    LEASE_LOST = "lease_lost"
    """The lease expired or was fenced: no reservation covers the request any more."""
    CLAIM_LOST = "claim_lost"
    """The item's claim moved on (cancelled, expired, reaped)."""
    STALLED = "stalled"
    """The stream sent nothing while the engine made no progress at all (a hung engine)."""
    SHUTDOWN = "shutdown"
    """The worker stops and the grace period is over."""


class StopAction(Enum):
    """What a stopped attempt's item gets."""

    PREEMPT = "preempt"
    """running -> preempted -> queued, its progress kept (a preemption counts)."""
    REQUEUE = "requeue"
    """running -> queued, its progress kept."""
    ENGINE_FAULT = "engine_fault"
    """Handled as an engine error: requeued, or failed at the attempt cap."""
    NOTHING = "nothing"
    """Nothing of this worker's to write (the item moved on); the lease is released."""


_AFTER_STOP = {
    StopReason.PREEMPTED: StopAction.PREEMPT,
    StopReason.SHUTDOWN: StopAction.REQUEUE,
    StopReason.LEASE_LOST: StopAction.REQUEUE,
    StopReason.STALLED: StopAction.ENGINE_FAULT,
    StopReason.CLAIM_LOST: StopAction.NOTHING,
}


def after_stop(reason: StopReason | None) -> StopAction:
    """What the item of an attempt stopped for ``reason`` gets (None: cancelled without a
    reason of the dispatcher's, as at shutdown)."""
    return _AFTER_STOP[reason or StopReason.SHUTDOWN]


def heartbeat_stop(claim_held: bool, lease: LeaseStatus | None) -> StopReason | None:
    """Why a heartbeat stops an attempt, or None: its claim in Postgres is gone, or the
    ledger says its lease was preempted or is lost (``lease`` None: the ledger did not
    answer, which stops nothing)."""
    if not claim_held:
        return StopReason.CLAIM_LOST
    if lease is LeaseStatus.PREEMPTED:
        return StopReason.PREEMPTED
    if lease in (LeaseStatus.EXPIRED, LeaseStatus.FENCED):
        # No reservation covers this request any more: stop engine work at once.
        return StopReason.LEASE_LOST
    return None


def stalled(
    flights: Iterable[FlightView], progressed_at: float, now: float, timeout_s: float
) -> list[FlightView]:
    """The attempts that heard nothing from the engine for ``timeout_s``, counted from their
    last chunk or the engine's last progress, whichever came later."""
    return [f for f in flights if now - max(f.last_chunk_at, progressed_at) > timeout_s]


V = TypeVar("V", bound=VictimCandidate)


def ttft_victims(preempt: int, engine_pauses_batch: bool, running: Iterable[V]) -> tuple[V, ...]:
    """The running batch attempts to preempt for a work budget step that asks ``preempt``
    of them (``BudgetStep.preempt``). None where the engine's own scheduler pauses batch in
    the steps interactive work needs: preempting would only throw batch work away."""
    if not preempt or engine_pauses_batch:
        return ()
    return budget_victims(running, preempt)
