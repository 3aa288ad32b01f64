"""How many items a node starts and claims now: the first plans of a dispatch round, and
which claims a heartbeat extends.

:func:`start_room` bounds new attempts by the node's sequence cap, the work budget and a
suspect engine; :func:`claim_size` bounds the claim by what the batch slack and the work
budget's prefill room could take, judged by recent reservations and prompts, so a busy node
does not churn items through claim -> deferred (each round costs Postgres writes).
:func:`claims_due` picks the claims a heartbeat must extend in Postgres, so a claim is
rewritten every few beats rather than every beat.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from backfill.dispatch.view import BatchLoad, NodeView
from backfill.work_budget import WorkBudget, admissible


def start_room(
    load: BatchLoad,
    budget: WorkBudget | None,
    max_in_flight: int,
    *,
    engine_suspect: bool = False,
) -> int:
    """How many new attempts the node may hold now (0: none).

    ``max_in_flight`` bounds every attempt held; the work budget bounds the active ones and
    holds all starts while it says so; a suspect engine (an attempt stalled on it) gets one
    attempt at a time, so a hang spends the attempts of one item per stall timeout."""
    room = max_in_flight - load.in_flight
    if budget is not None:
        if budget.hold:
            return 0
        room = min(room, budget.max_seqs - load.active)
    if engine_suspect:
        room = min(room, 1 - load.in_flight)
    return max(room, 0)


def startable(load: BatchLoad, budget: WorkBudget | None, prompts: Sequence[int]) -> int:
    """How many of ``prompts`` (prompt tokens, in start order) the work budget lets start."""
    if budget is None:
        return len(prompts)
    return admissible(budget, load.active, load.prefilling, prompts)


def claim_size(view: NodeView, room: int, claim_batch: int, slack: int, block_size: int) -> int:
    """How many items to claim with ``room`` for new attempts and ``slack`` tokens of batch
    slack (0: claim nothing now)."""
    if room <= 0 or slack < block_size:
        return 0
    want = min(room, claim_batch)
    if view.typical_reservation:
        fit = slack // view.typical_reservation
        if fit == 0 and view.holds_leases:
            # Less slack than one typical reservation while leases are held: the claim would
            # be deferred at reserve time (a retry delay for the item, writes for Postgres)
            # and requeued. A lease ending frees slack and wakes the loop.
            return 0
        want = max(1, min(want, fit))
    if view.budget is not None and view.typical_prompt:
        # Nor more than the work budget's prefill room could start: a claim it cuts short
        # goes back to the queue, and claiming it again costs Postgres writes each time.
        want = startable(view.load, view.budget, [view.typical_prompt] * want)
    return want


def claims_due(
    extended_at: Mapping[int, float], now: float, interval_s: float, ttl_s: float
) -> list[int]:
    """The claims (item ids) a heartbeat at ``now`` extends in Postgres: those extended more
    than half the TTL less one and a half beats ago. ``extended_at`` is when each claim's
    expiry was last set (on this clock, taken before the write was sent), so each expires
    ``ttl_s`` after it at the earliest.

    Each extension rewrites the item's row (its expiry is indexed, so no update is HOT): at
    the defaults (30 s TTL, a 5 s beat) a claim is extended every other beat, beats a little
    late or not, and has more than 15 s left at every beat on time (12.5 s at one a whole
    interval late); a beat of a third of the TTL or longer extends every claim every beat, as
    before. The ledger's lease is still beaten every beat, so a preempted or lost lease stops
    its attempt within one beat as before; a claim ended in Postgres (its job cancelled or
    expired) whose lease the tick's preempt notice did not stop (a lease past its preemptions)
    is seen at its next extension, within two beats."""
    return sorted(i for i, at in extended_at.items() if now - at > ttl_s / 2 - 1.5 * interval_s)
