"""Weighted fair share of batch capacity between tenants: pure decisions, no I/O.

What is shared is a node's batch *sequences in flight* (items reserved or running there).
Every sequence that decodes yields one output token per engine step whatever its length, so a
tenant's share of the sequences is its share of the node's output tokens, which is what
fairness is judged by. Tokens held would not do: a tenant of short requests holds fewer
tokens per sequence, and would get more sequences, and so more of the output, for the same
"share".

Two decisions, both against the tenant's ``weight`` (default 1, in its record):

* :func:`claim_order` — whose items the next claim takes, slot by slot: each slot goes to the
  tenant with the lowest finish tag ``(in flight + slots given + 1) / weight`` among those with
  claimable work (weighted fair queueing over sequences). Only tenants with work are asked, so
  an idle tenant's share goes to the others (work-conserving), and a tenant alone gets every
  slot. Which items of a tenant fill its slots stays earliest deadline first.
* :func:`tokens_until_done` — deadline feasibility under the same sharing: the tokens the
  deployment works through, all tenants together, until a tenant's backlog and a new batch of
  its own are done, when every tenant with backlog is served at its weighted share and a
  tenant that runs out gives its share to the rest (generalised processor sharing). A tenant
  alone gets the whole throughput; beside others it is judged at its share, not behind their
  whole backlog.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TenantUse:
    """A tenant with work to claim, as one node sees it."""

    tenant_id: str
    weight: float
    in_flight: int
    """Batch sequences the node holds for the tenant now (items reserved or running there)."""


@dataclass(frozen=True, slots=True)
class TenantBacklog:
    """A tenant's unfinished batch work, in worst-case tokens."""

    tenant_id: str
    weight: float
    tokens: int


def claim_order(waiting: Iterable[TenantUse], slots: int) -> tuple[str, ...]:
    """The tenant of each of the next ``slots`` claimed items, in the order to start them.

    Ties (equal finish tags) go to the heavier tenant, then by tenant id, so a plan is the
    same every time it is made from the same view.
    """
    heap: list[tuple[float, float, str, int, float]] = []
    for use in waiting:
        if use.weight <= 0:
            raise ValueError(f"tenant {use.tenant_id} has weight {use.weight}; weights are > 0")
        held = max(use.in_flight, 0)
        heap.append(((held + 1) / use.weight, -use.weight, use.tenant_id, held + 1, use.weight))
    heapq.heapify(heap)
    order: list[str] = []
    while heap and len(order) < slots:
        _, neg_weight, tenant, given, weight = heap[0]
        order.append(tenant)
        heapq.heapreplace(heap, ((given + 1) / weight, neg_weight, tenant, given + 1, weight))
    return tuple(order)


def tokens_until_done(
    backlogs: Sequence[TenantBacklog], tenant_id: str, weight: float, batch_tokens: int
) -> int:
    """Tokens processed, every tenant's together, until ``tenant_id``'s backlog plus a new
    batch of ``batch_tokens`` are done (divide by the deployment's throughput for the time).

    Under generalised processor sharing every tenant with backlog has received the same
    service per unit of weight at any moment, until it runs out; so when this tenant has
    worked through its own ``T`` tokens, another tenant ``i`` has had ``min(B_i, w_i T / w)``.
    Earliest deadline first within the tenant may run the new batch before the tenant's older
    work; counting all of the tenant's own backlog ahead of it is the safe bound.
    """
    if weight <= 0:
        raise ValueError(f"weight {weight} is not > 0")
    own = max(batch_tokens, 0) + sum(max(b.tokens, 0) for b in backlogs if b.tenant_id == tenant_id)
    per_weight = own / weight
    others = sum(
        min(max(b.tokens, 0), b.weight * per_weight) for b in backlogs if b.tenant_id != tenant_id
    )
    return own + round(others)
