"""Which checked items a node starts: those the slack and the work budget take, reserved in
the ledger.

:func:`fit_starts` keeps the prefix of the checked items (in the claim's order: fair share,
then deadlines) that the batch slack can hold and the work budget lets start; the rest goes
back to the queue at once, in one write, rather than being deferred one by one.
:func:`reserve_request` is the reservation one item asks of the ledger, and
:func:`after_reserve` what its answer means for the item.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backfill.dispatch.checks import CheckedItem
from backfill.dispatch.claims import startable
from backfill.dispatch.outcomes import Fail, GiveBack, error_json
from backfill.dispatch.view import NodeView
from backfill.ledger import Denial, Lease, ReserveRequest
from backfill.policy import ServiceClass
from backfill.states import ItemState
from backfill.store import Start


@dataclass(frozen=True, slots=True)
class StartPlan:
    """The checked items to reserve now, and those that go back to the queue unstarted."""

    fits: tuple[CheckedItem, ...]
    rest: tuple[CheckedItem, ...]
    detail: str
    """Why ``rest`` goes back: "work budget full" or "slack full"."""


def fit_starts(
    checked: Sequence[CheckedItem],
    view: NodeView,
    slack: int,
    block_size: int,
    *,
    shares: Sequence[int] = (),
    held_prefixes: frozenset[str] = frozenset(),
    cached: Sequence[int] = (),
) -> StartPlan:
    """The prefix of ``checked`` that ``slack`` tokens can take and the work budget lets
    start. ``shares``: what of each item's reservation is its shared prefix
    (``backfill.dispatch.prefix_starts``), asked of the slack only where the node's ledger
    does not hold the prefix yet (``held_prefixes``, or an earlier item of ``checked``).
    ``cached``: what of each item's prompt the engine takes from its prefix cache; the work
    budget's prefill room is charged the rest, what the engine computes (a leaning item
    charged its whole prompt let a budget of 16,384 tokens start 11 items of a 1,400-token
    prompt at once where 38 prefill 430 tokens each)."""
    fits: list[CheckedItem] = []
    used = 0
    held = set(held_prefixes)
    for at, item in enumerate(checked):
        need = item.reservation(block_size)
        share = shares[at] if at < len(shares) else 0
        if share and item.item.prefix_id is not None:
            if item.item.prefix_id in held:
                need -= share
            held.add(item.item.prefix_id)
        # The first item goes to the ledger even when it looks too big only if the node holds
        # nothing (the slack may have grown; a denial then says why); with leases held it goes
        # back to the queue at once instead of being deferred.
        if used + need > slack and (fits or view.holds_leases):
            break
        fits.append(item)
        used += need
    budgeted = startable(view.load, view.budget, prefill_tokens(fits, cached))
    detail = "work budget full" if budgeted < len(fits) else "slack full"
    return StartPlan(tuple(fits[:budgeted]), tuple(checked[budgeted:]), detail)


def prefill_tokens(checked: Sequence[CheckedItem], cached: Sequence[int] = ()) -> list[int]:
    """The prompt tokens the engine computes for each of ``checked``: its prompt less what
    ``cached`` says the engine takes from its prefix cache."""
    return [c.count.total - (cached[at] if at < len(cached) else 0) for at, c in enumerate(checked)]


def reserve_request(
    checked: CheckedItem,
    node: str,
    *,
    max_preemptions: int,
    lease_ttl_s: float,
    prefix_tokens: int = 0,
) -> ReserveRequest:
    """The reservation ``checked``'s run asks of the node's batch slack (``prefix_tokens``
    of it the item's shared prefix: ``backfill.dispatch.prefix_starts``)."""
    item = checked.item
    return ReserveRequest(
        node=node,
        service_class=ServiceClass.BATCH,
        # What this run prefills (a continuation's prompt carries its partial output) and
        # what it may still generate, for every sequence it creates.
        prompt_tokens=checked.count.longest,
        max_output_tokens=checked.max_output,
        n=checked.count.sequences,
        owner=f"{node}/{item.id}/{item.attempt}",
        preemptible=preemptible(item.preemptions, max_preemptions),
        deadline_ms=int(item.deadline.timestamp() * 1000),
        ttl_ms=int(lease_ttl_s * 1000),
        prefix_id=item.prefix_id if prefix_tokens else None,
        prefix_tokens=prefix_tokens,
    )


def preemptible(preemptions: int, max_preemptions: int) -> bool:
    """Whether an item preempted ``preemptions`` times may be preempted again: at the cap it
    reserves as non-preemptible, so it cannot thrash."""
    return preemptions < max_preemptions


def after_reserve(outcome: Lease | Denial | BaseException) -> Lease | GiveBack | Fail:
    """What the ledger's answer to one reservation means: the item starts under the
    :class:`Lease`, goes back to the queue (the ledger call failed; or no slack now, deferred
    for as long as the ledger says), or fails (the reservation can never be granted)."""
    if isinstance(outcome, BaseException):
        return GiveBack(f"reserve failed: {outcome}")
    if isinstance(outcome, Denial):
        if outcome.permanent:
            return Fail(error_json("reservation_refused", str(outcome.reason)))
        return GiveBack(
            f"no slack: {outcome.reason}", ItemState.DEFERRED, outcome.retry_after_s or 1.0
        )
    return outcome


@dataclass(frozen=True, slots=True)
class Leased:
    """A checked item the ledger granted a lease: what its start writes to Postgres."""

    checked: CheckedItem
    lease: Lease
    cached_tokens: int = 0
    """What of its prompt the engine takes from its prefix cache (``PrefixStarts.cached``)."""

    @property
    def prefill(self) -> int:
        """The prompt tokens the engine computes for it: what the attempt counts against the
        work budget's prefill room until its first token."""
        return self.checked.count.total - self.cached_tokens

    def start(self) -> Start:
        item, lease = self.checked.item, self.lease
        return Start(
            item.id,
            item.attempt,
            lease.lease_id,
            lease.fencing_token,
            lease.tokens,
            self.checked.prompt_tokens,
            lease.prefix_tokens,
        )
