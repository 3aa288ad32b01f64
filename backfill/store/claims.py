"""Claims: the worker's path from a claimable item to a running attempt, and back when unstarted.

Claims share each node between tenants by weight (``backfill.fairshare`` decides, the claim
statement carries the plan out), earliest deadline first within a tenant. ``FOR UPDATE SKIP
LOCKED`` lets many claimers run at once without handing one item to two; each claim bumps
the item's attempt number, which fences out any older attempt's writes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from backfill import fairshare
from backfill.errors import StaleWrite
from backfill.models import ACTIVE_SQL, CLAIMABLE_SQL
from backfill.states import ITEM_CLAIMABLE, ItemState
from backfill.store.bodies import ITEM_BODY
from backfill.store.counters import CNT_CLAIM, CNT_START, CNT_UNCLAIM
from backfill.store.database import Store
from backfill.store.driver import array_literal, session
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

# Moves the ``picked`` items to ``reserved`` for this attempt, counts them, and returns them
# in ``picked.ord`` order; ``{extra}``: more CTEs over ``moved`` in the same statement.
_CLAIM_MOVE = (
    "moved AS ("
    "  UPDATE items i SET state = 'reserved', attempt = i.attempt + 1, "
    "    node = :node, lease_id = NULL, fencing_token = NULL, not_before = NULL, "
    "    lease_expires_at = now() + make_interval(secs => :ttl), "
    "    updated_at = now() "
    "  FROM picked p WHERE i.id = p.id AND p.state = ANY(:src) "
    f"  RETURNING i.id, i.job_id, i.attempt, i.custom_id, {ITEM_BODY} AS body, i.deadline, "
    "    i.prompt_tokens, i.max_output_tokens, i.output_defaulted, i.reservation_tokens, "
    "    i.preemptions, i.partial_output, i.partial_tokens, p.state AS from_state, p.ord, "
    "    EXTRACT(EPOCH FROM (i.deadline - now()))::float8 AS deadline_left_s"
    f"), {CNT_CLAIM}{{extra}} "
    "SELECT m.*, j.endpoint, j.tenant_id FROM moved m JOIN jobs j ON j.id = m.job_id "
    "ORDER BY m.ord"
)

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
    """The claim statement with and without fair share, both with the same extra CTEs."""

    edf: str
    fair: str


def claim_statements(extra: str = "") -> ClaimStatements:
    """The claim statements; ``extra``: CTEs over ``moved`` (the claimed rows, as the claim
    returns them) written in the same statement, e.g. a hold's attempt rows."""
    move = _CLAIM_MOVE.format(extra=f", {extra}" if extra else "")
    return ClaimStatements(edf=_PICK_EDF + move, fair=_PICK_FAIR + move)


def pick_statements(select: str) -> ClaimStatements:
    """The claim's pick, with and without fair share, followed by ``select`` over ``picked``
    (id, state, ord: the items locked for the claim) instead of the claim's move."""
    return ClaimStatements(
        edf=_PICK_EDF.rstrip(", ") + " " + select, fair=_PICK_FAIR.rstrip(", ") + " " + select
    )


_CLAIMS = claim_statements()

# The batch statements over items by id below check the state as ``(...) IS TRUE``: a filter,
# so the planner finds each item by primary key rather than reading the partial indexes of
# active items, dead entries and all (see ``FINISH`` in backfill.store.items).

# reserved -> running for many claims at once, each with its lease and fencing token; opens their
# attempt rows and moves the counters.
START_MANY = (
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
    "CAST(:att AS int[]), CAST(:lid AS text[]), CAST(:fen AS bigint[]), "
    "CAST(:res AS int[]), CAST(:pt AS int[])) AS v(id, a, l, f, r, p)), "
    "moved AS (UPDATE items i SET state = 'running', lease_id = v.l, "
    "  fencing_token = v.f, reservation_tokens = v.r, prompt_tokens = v.p, "
    "  lease_expires_at = now() + make_interval(secs => :ttl), "
    "  started_at = coalesce(i.started_at, now()), updated_at = now() "
    "  FROM v WHERE i.id = v.id AND i.attempt = v.a AND (i.state = 'reserved') IS TRUE "
    "  RETURNING i.id, i.job_id, i.attempt, i.node, v.l, v.f, v.r, v.p), "
    f"{CNT_START}, "
    "att AS (INSERT INTO attempts (item_id, attempt, node, lease_id, "
    "  fencing_token, reserved_tokens, prompt_tokens) "
    "  SELECT id, attempt, node, l, f, r, p FROM moved "
    "  ON CONFLICT (item_id, attempt) DO UPDATE SET lease_id = EXCLUDED.lease_id, "
    "  fencing_token = EXCLUDED.fencing_token, "
    "  reserved_tokens = EXCLUDED.reserved_tokens, "
    "  prompt_tokens = EXCLUDED.prompt_tokens) "
    "SELECT id, job_id FROM moved"
)

# Extend the claim of many (item, attempt) pairs still active; returns those still held.
HEARTBEAT = (
    "UPDATE items i SET lease_expires_at = now() + make_interval(secs => :t) "
    "FROM unnest(CAST(:ids AS bigint[]), CAST(:att AS int[])) AS v(id, a) "
    f"WHERE i.id = v.id AND i.attempt = v.a AND (i.state IN ({ACTIVE_SQL})) IS TRUE "
    "RETURNING i.id"
)

# reserved -> queued for many claims given back unstarted, with their attempt rows and counters.
UNCLAIM = (
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
    "CAST(:att AS int[])) AS v(id, a)), "
    "moved AS (UPDATE items i SET state = 'queued', lease_id = NULL, "
    "  fencing_token = NULL, lease_expires_at = NULL, updated_at = now() "
    "  FROM v WHERE i.id = v.id AND i.attempt = v.a AND (i.state = 'reserved') IS TRUE "
    "  RETURNING i.id, i.job_id, i.attempt, i.node), "
    f"{CNT_UNCLAIM}, "
    "att AS (INSERT INTO attempts (item_id, attempt, node, ended_at, outcome, "
    "  detail) SELECT id, attempt, coalesce(node, ''), now(), 'released', :d "
    "  FROM moved ON CONFLICT (item_id, attempt) DO NOTHING) "
    "SELECT id FROM moved"
)


class Claims(Store):
    """Claiming, starting, heartbeating and unclaiming items."""

    def claim(
        self,
        node: str,
        limit: int,
        lease_ttl_s: float,
        *,
        models: Sequence[str] | None = None,
    ) -> list[ClaimedItem]:
        """Hand up to ``limit`` claimable items to one attempt each, in the order to start them.

        ``models``: only items of jobs naming one of these (the models the node's engine
        serves), or naming none; None takes any.

        With fair share (the default) the node's share view is read first, in the same
        transaction, and ``fairshare.claim_order`` plans whose items to take; the claim
        statement then takes each tenant's quota earliest deadline first, in the plan's
        order. With several tenants the plan asks for twice ``limit`` slots, so a tenant that
        has fewer items than its slots (all held by other nodes, or not due yet) passes its
        turn to the next tenant in fair order, and whatever is still short is filled earliest
        deadline first from every tenant: no claim comes back short while items wait.
        Without fair share, the earliest deadlines across all tenants.

        ``FOR UPDATE SKIP LOCKED`` lets many claimers run at once without ever handing one
        item to two of them; each claimed item's attempt number goes up by one, which fences
        out any older attempt's writes.
        """
        with session(self.engine, durable=False) as tx:
            statement, params = self._claim_statement(
                tx.rows, node, limit, lease_ttl_s, models, _CLAIMS
            )
            rows = tx.rows(statement, params)
        return [self._claimed(r) for r in rows]

    @staticmethod
    def _claimed(r: Any) -> ClaimedItem:
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

    def _claim_statement(
        self,
        read: Callable[[str, dict[str, Any]], Sequence[Any]],
        node: str,
        limit: int,
        lease_ttl_s: float,
        models: Sequence[str] | None,
        statements: ClaimStatements,
    ) -> tuple[str, dict[str, Any]]:
        """The claim statement of ``statements`` and its parameters (with fair share, the
        plan read by ``read`` in the claim's transaction)."""
        read(f"SELECT {CLAIM_PLANNER}", {})
        view = read(*self._share_view(node, models)) if self.fair_share else None
        return self._planned_claim(view, node, limit, lease_ttl_s, models, statements)

    @staticmethod
    def _share_view(node: str, models: Sequence[str] | None) -> tuple[str, dict[str, Any]]:
        """The fair share plan's read: the tenants with work and what ``node`` holds of each."""
        return _SHARE_VIEW, {"node": node, "models": list(models) if models is not None else None}

    def _planned_claim(
        self,
        view: Sequence[Any] | None,
        node: str,
        limit: int,
        lease_ttl_s: float,
        models: Sequence[str] | None,
        statements: ClaimStatements,
    ) -> tuple[str, dict[str, Any]]:
        """The claim statement of ``statements`` and its parameters, planned from the share
        view's rows (None: no fair share, the earliest deadlines across every tenant)."""
        params: dict[str, Any] = {
            "n": limit,
            "node": node,
            "ttl": lease_ttl_s,
            "src": check_moves(ITEM_CLAIMABLE, ItemState.RESERVED),
            "models": list(models) if models is not None else None,
        }
        if view is None:
            return statements.edf, params
        use = [fairshare.TenantUse(r[0], float(r[1]), int(r[2])) for r in view]
        # Spare slots only matter where a tenant short of items can pass its turn on.
        spare = limit if len(use) > 1 else 0
        params["slots"] = array_literal(fairshare.claim_order(use, limit + spare))
        return statements.fair, params

    def explain_claim(self, node: str, limit: int, *, models: Sequence[str] | None = None) -> Any:
        """``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`` of the claim :meth:`claim` would run
        now, in a transaction rolled back (nothing is claimed): the plan, for studies
        (``bench.pg_scale``) and the test that pins its shape."""
        with self.engine.connect() as conn:
            tx = conn.begin()
            try:
                statement, params = self._claim_statement(
                    lambda q, p: conn.execute(text(q), p).all(), node, limit, 60.0, models, _CLAIMS
                )
                explain = text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement)
                plan = conn.execute(explain, params).scalar_one()
            finally:
                tx.rollback()
        return json.loads(plan) if isinstance(plan, str) else plan

    def start(
        self,
        item_id: int,
        attempt: int,
        *,
        lease_id: str,
        fencing_token: int,
        reservation_tokens: int,
        prompt_tokens: int,
        lease_ttl_s: float,
    ) -> None:
        """reserved -> running for one item; ``StaleWrite`` if its claim moved on."""
        start = Start(item_id, attempt, lease_id, fencing_token, reservation_tokens, prompt_tokens)
        if not self.start_many([start], lease_ttl_s):
            raise StaleWrite(f"item {item_id} attempt {attempt} no longer holds its claim")

    def start_many(self, starts: Sequence[Start], lease_ttl_s: float) -> list[int]:
        """reserved -> running, once each attempt holds a ledger lease that fits; returns the
        ids that applied (the others' claims moved on: their leases must be released)."""
        check_moves([ItemState.RESERVED], ItemState.RUNNING)
        if not starts:
            return []
        starts = in_id_order(starts, lambda s: s.item_id)
        with session(self.engine, durable=False) as tx:
            return tx.column(
                START_MANY,
                {
                    "ids": array_literal(x.item_id for x in starts),
                    "att": array_literal(x.attempt for x in starts),
                    "lid": array_literal(x.lease_id for x in starts),
                    "fen": array_literal(x.fencing_token for x in starts),
                    "res": array_literal(x.reservation_tokens for x in starts),
                    "pt": array_literal(x.prompt_tokens for x in starts),
                    "ttl": lease_ttl_s,
                },
            )

    def heartbeat(self, held: Sequence[tuple[int, int]], lease_ttl_s: float) -> list[int]:
        """Extend the claims of (item_id, attempt) pairs; returns the ids still held."""
        if not held:
            return []
        held = in_id_order(held, lambda h: h[0])
        with self._tx() as conn:
            return list(
                conn.execute(
                    text(HEARTBEAT),
                    {"t": lease_ttl_s, "ids": [h[0] for h in held], "att": [h[1] for h in held]},
                ).scalars()
            )

    def unclaim(self, held: Sequence[tuple[int, int]], detail: str) -> list[int]:
        """reserved -> queued for many (item_id, attempt) claims given back unstarted (the
        slack could not take them); returns the ids that applied."""
        check_moves([ItemState.RESERVED], ItemState.QUEUED)
        if not held:
            return []
        held = in_id_order(held, lambda h: h[0])
        with self._tx(durable=False) as conn:
            rows = conn.execute(
                text(UNCLAIM),
                {"ids": [h[0] for h in held], "att": [h[1] for h in held], "d": detail},
            ).all()
        return [r.id for r in rows]
