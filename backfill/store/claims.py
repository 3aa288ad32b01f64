"""The claim's pick: which claimable items a node takes and in which order, and the heartbeat's
statement that keeps a claim's items held (the role that sends them:
:class:`backfill.store.open_claims.Claims`).

Claims share each node between tenants by weight (``backfill.fairshare`` decides, the claim
statement carries the plan out), earliest deadline first within a tenant. ``FOR UPDATE SKIP
LOCKED`` lets many claimers run at once without handing one item to two. The worker's claim
(``backfill.store.open_claims``) sends :data:`PICKS` in an open transaction and starts the
items under a new attempt number, which fences out any older attempt's writes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from backfill import fairshare
from backfill.models import ACTIVE_SQL, CLAIMABLE_SQL
from backfill.states import ITEM_CLAIMABLE, ItemState
from backfill.store.bodies import ITEM_BODY
from backfill.store.driver import array_literal
from backfill.store.moves import check_moves, decode_partial, in_id_order
from backfill.store.records import ClaimedItem, Start

# The condition an item must meet to be claimed now (a WHERE clause over items).
CLAIMABLE_NOW = (
    f"state IN ({CLAIMABLE_SQL}) AND deadline > now() "
    "AND (not_before IS NULL OR not_before <= now()) "
    # Only a running job's items: never those of a job being validated, cancelled or
    # ended, whatever state its items were left in; of a model the claiming node's engine
    # serves (NULL: any, for tools and tests). A scalar subquery, not EXISTS: the planner turns
    # EXISTS into a hash join that reads every claimable item and sorts them to keep :n (the
    # claim then grows with the backlog: 473 ms at 100,000 waiting, bench.pg_scale); as a
    # per-row filter the claim index is walked in deadline order and stops after :n rows.
    "AND coalesce((SELECT jb.state = 'in_progress' "
    "  AND (CAST(:models AS text[]) IS NULL OR jb.model IS NULL "
    "       OR jb.model = ANY(CAST(:models AS text[]))) "
    # On a node that looks for shared prompt prefixes (``:prefix_hold_s`` not NULL), not the
    # items of a job whose prefix pass has not ended that the pass has not recorded yet (its
    # pages go in id order: those above ``prefixes_upto``), for that long after the job went
    # in progress: claimed before the pass, an item would reserve its whole prompt (issue 36).
    # A job no finder takes (no model named) is not held; one whose pass never ends is held
    # only that long. Read from the job's row the filter reads already: no extra round trip.
    "  AND (CAST(:prefix_hold_s AS float8) IS NULL OR jb.prefixes_ended_at IS NOT NULL "
    "       OR items.id <= jb.prefixes_upto "
    "       OR jb.model IS NULL OR jb.in_progress_at IS NULL "
    "       OR jb.in_progress_at "
    "          <= now() - make_interval(secs => CAST(:prefix_hold_s AS float8))) "
    "  FROM jobs jb WHERE jb.id = items.job_id), false)"
)

# The tenants with work (jobs in progress; one whose items are all held elsewhere passes its
# slots on in the claim), their weights, and the batch sequences this node holds for each.
_SHARE_VIEW = (
    "WITH waiting AS (SELECT DISTINCT tenant_id FROM jobs WHERE state = 'in_progress' "
    "  AND (CAST(:models AS text[]) IS NULL OR model IS NULL "
    "       OR model = ANY(CAST(:models AS text[])))), "
    "held AS (SELECT tenant_id, count(*) AS n FROM items "
    f"  WHERE node = :node AND state IN ({ACTIVE_SQL}) GROUP BY tenant_id) "
    "SELECT t.id, t.weight, coalesce(h.n, 0) FROM waiting w "
    "JOIN tenants t ON t.id = w.tenant_id LEFT JOIN held h ON h.tenant_id = w.tenant_id"
)

# The claim's planner setting, for its transaction only. Its plan must walk a claim index in
# deadline order and stop after the items it takes; the planner's estimate of the claimable
# items comes from statistics that a large submission leaves stale (autovacuum analyzes items
# once a tenth of the table changed: on a large table, long after), and expecting few it chose a
# bitmap scan, which reads every claimable item and sorts them all to keep ``:n`` (plain EDF,
# 20,000 waiting: 27,975 buffers and 24 ms against 1.2 ms once analyzed; test_claim_plan.py).
CLAIM_PLANNER = "set_config('enable_bitmapscan', 'off', true)"

# Claim without fair share: the earliest deadlines across every tenant.
_PICK_EDF = (
    "WITH picked AS ("
    "  SELECT id, state, row_number() OVER (ORDER BY deadline, id) AS ord FROM ("
    f"    SELECT id, state, deadline FROM items WHERE {CLAIMABLE_NOW}"
    "    ORDER BY deadline, id LIMIT :n FOR UPDATE SKIP LOCKED) e), "
)

# ``:slots`` is the plan: the tenant of each slot, in order. The k-th slot of a tenant takes
# its k-th earliest-deadline item; the first ``:n`` slots that found one are the claim, and
# any shortfall is filled earliest deadline first across all tenants (``rest``). Items locked
# for slots past the first ``:n`` are not claimed and unlock at commit.
_PICK_FAIR = (
    "WITH slots AS ("
    "  SELECT s.tenant_id, s.ord, "
    "    row_number() OVER (PARTITION BY s.tenant_id ORDER BY s.ord) AS k "
    "  FROM unnest(CAST(:slots AS text[])) WITH ORDINALITY AS s(tenant_id, ord)), "
    "quota AS (SELECT tenant_id, count(*) AS n FROM slots GROUP BY tenant_id), "
    "taken AS ("
    "  SELECT q.tenant_id, c.id, c.state, "
    "    row_number() OVER (PARTITION BY q.tenant_id ORDER BY c.deadline, c.id) AS k "
    "  FROM quota q CROSS JOIN LATERAL ("
    "    SELECT id, state, deadline FROM items"
    f"    WHERE tenant_id = q.tenant_id AND {CLAIMABLE_NOW}"
    "    ORDER BY deadline, id LIMIT q.n FOR UPDATE SKIP LOCKED) c), "
    "fair AS ("
    "  SELECT t.id, t.state, s.ord FROM taken t "
    "  JOIN slots s ON s.tenant_id = t.tenant_id AND s.k = t.k ORDER BY s.ord LIMIT :n), "
    "rest AS ("
    "  SELECT id, state, deadline FROM items"
    f"  WHERE {CLAIMABLE_NOW} AND id <> ALL (ARRAY(SELECT id FROM taken))"
    "  ORDER BY deadline, id LIMIT greatest(0, :n - (SELECT count(*) FROM fair))"
    "  FOR UPDATE SKIP LOCKED), "
    "picked AS ("
    "  SELECT id, state, ord FROM fair UNION ALL "
    "  SELECT id, state, CAST(:n AS bigint) * 2 + row_number() OVER (ORDER BY deadline, id) "
    "  FROM rest), "
)


@dataclass(frozen=True, slots=True)
class ClaimStatements:
    """The claim's statement with and without fair share."""

    edf: str
    fair: str


def pick_statements(select: str) -> ClaimStatements:
    """The claim's pick, with and without fair share, followed by ``select`` over ``picked``
    (id, state, ord: the items locked for the claim)."""
    return ClaimStatements(
        edf=_PICK_EDF.rstrip(", ") + " " + select, fair=_PICK_FAIR.rstrip(", ") + " " + select
    )


# The picked items as the worker needs them, in ``picked.ord`` order, still unwritten; each
# under the attempt number its start will give it.
_PICKED = (
    f"SELECT i.id, i.job_id, i.attempt + 1 AS attempt, i.custom_id, {ITEM_BODY} AS body, "
    "i.deadline, i.prompt_tokens, i.max_output_tokens, i.output_defaulted, "
    "i.reservation_tokens, i.preemptions, i.prefix_id, i.prefix_blocks, "
    "i.partial_output, i.partial_tokens, j.endpoint, j.tenant_id, p.state AS from_state, "
    "EXTRACT(EPOCH FROM (i.deadline - now()))::float8 AS deadline_left_s "
    "FROM picked p JOIN items i ON i.id = p.id JOIN jobs j ON j.id = i.job_id "
    "WHERE p.state = ANY(:src) ORDER BY p.ord"
)

PICKS: ClaimStatements = pick_statements(_PICKED)
"""The open claim's pick (``backfill.store.open_claims``), with and without fair share."""

# The batch statements over items by id below check the state as ``(...) IS TRUE``: a filter,
# so the planner finds each item by primary key rather than reading the partial indexes of
# active items, dead entries and all (see ``FINISH`` in backfill.store.items).

# Extend the claim of many (item, attempt) pairs still active; returns those still held.
HEARTBEAT = (
    "UPDATE items i SET lease_expires_at = now() + make_interval(secs => :t) "
    "FROM unnest(CAST(:ids AS bigint[]), CAST(:att AS int[])) AS v(id, a) "
    f"WHERE i.id = v.id AND i.attempt = v.a AND (i.state IN ({ACTIVE_SQL})) IS TRUE "
    "RETURNING i.id"
)


def claimed_item(r: Any) -> ClaimedItem:
    """A claim statement's row as the item handed to the attempt."""
    return ClaimedItem(
        id=r.id,
        job_id=r.job_id,
        attempt=r.attempt,
        custom_id=r.custom_id,
        body=r.body,
        deadline=r.deadline,
        prompt_tokens=r.prompt_tokens,
        max_output_tokens=r.max_output_tokens,
        reservation_tokens=r.reservation_tokens,
        preemptions=r.preemptions,
        partial_output=decode_partial(r.partial_output),
        partial_tokens=r.partial_tokens,
        endpoint=r.endpoint,
        deadline_left_s=r.deadline_left_s,
        tenant_id=r.tenant_id,
        output_defaulted=r.output_defaulted,
    )


def claim_statement(
    read: Callable[[str, dict[str, Any]], Sequence[Any]],
    fair_share: bool,
    node: str,
    limit: int,
    lease_ttl_s: float,
    models: Sequence[str] | None,
    statements: ClaimStatements,
) -> tuple[str, dict[str, Any]]:
    """The claim statement of ``statements`` and its parameters (with ``fair_share``, the
    plan read by ``read`` in the claim's transaction)."""
    read(f"SELECT {CLAIM_PLANNER}", {})
    view = read(*share_view(node, models)) if fair_share else None
    return planned_claim(view, node, limit, lease_ttl_s, models, statements)


def share_view(node: str, models: Sequence[str] | None) -> tuple[str, dict[str, Any]]:
    """The fair share plan's read: the tenants with work and what ``node`` holds of each."""
    return _SHARE_VIEW, {"node": node, "models": list(models) if models is not None else None}


def planned_claim(
    view: Sequence[Any] | None,
    node: str,
    limit: int,
    lease_ttl_s: float,
    models: Sequence[str] | None,
    statements: ClaimStatements,
    prefix_hold_s: float | None = None,
) -> tuple[str, dict[str, Any]]:
    """The claim statement of ``statements`` and its parameters, planned from the share
    view's rows (None: no fair share, the earliest deadlines across every tenant).
    ``prefix_hold_s``: how long a new job's items wait for its prefix pass to end
    (``backfill.dispatch.prefix_claim_hold_s``; None: they do not wait).

    The order a claim takes items in: with fair share (the default) the node's share view is
    read first, in the claim's transaction, and ``fairshare.claim_order`` plans whose items to
    take; the claim statement then takes each tenant's quota earliest deadline first, in the
    plan's order. With several tenants the plan asks for twice ``limit`` slots, so a tenant
    that has fewer items than its slots (all held by other nodes, or not due yet) passes its
    turn to the next tenant in fair order, and whatever is still short is filled earliest
    deadline first from every tenant: no claim comes back short while items wait. Without
    fair share, the earliest deadlines across all tenants.

    ``models``: only items of jobs naming one of these (the models the node's engine serves),
    or naming none; None takes any.
    """
    params: dict[str, Any] = {
        "n": limit,
        "node": node,
        "ttl": lease_ttl_s,
        "src": check_moves(ITEM_CLAIMABLE, ItemState.RESERVED),
        "models": list(models) if models is not None else None,
        "prefix_hold_s": prefix_hold_s,
    }
    if view is None:
        return statements.edf, params
    use = [fairshare.TenantUse(r[0], float(r[1]), int(r[2])) for r in view]
    # Spare slots only matter where a tenant short of items can pass its turn on.
    spare = limit if len(use) > 1 else 0
    params["slots"] = array_literal(fairshare.claim_order(use, limit + spare))
    return statements.fair, params


def start_rows(starts: Sequence[Start], others: Sequence[tuple[int, int]]) -> list[tuple[Any, ...]]:
    """One row per item a start statement moves, in id order (the lock order): each of
    ``starts`` with its lease, each (item_id, attempt) of ``others`` with none (not started)."""
    rows: list[tuple[Any, ...]] = [
        (s.item_id, s.attempt, s.lease_id, s.fencing_token, s.reservation_tokens,
         s.prompt_tokens)
        for s in starts
    ]  # fmt: skip
    rows += [(item_id, attempt, None, None, None, None) for item_id, attempt in others]
    return in_id_order(rows, lambda r: int(r[0]))
