"""Open claims: the worker's claim path in one transaction, its items written once.

An **open claim** picks the claimable items (fair share between tenants, earliest deadline
first within one, ``FOR UPDATE SKIP LOCKED``) and keeps its transaction open: the items are
locked for this node, nothing is written yet. The worker counts their tokens and asks the
ledger for leases meanwhile, then **starts** the claim: one statement moves each item it
leased straight to ``running`` under a new attempt number (the fence against any older
attempt) with its lease id and fencing token, writes each attempt's row once and moves the
counters, and the transaction commits. An item the worker will not start now (the slack is
full) is simply left: it unlocks at commit, untouched, and no attempt of it is spent. An item
the worker refuses (a bad request, a deadline it cannot meet, a ledger denial) is *held* by the
same statement (``reserved`` under the new attempt: a *hold*), and the worker settles it after
the commit; those are the rare path.

Against the claim path it replaced (a hold and its commit: two transactions, each item and
its attempt row written twice before it runs), this is one transaction and one write of each.
What it costs, and what keeps the invariant (``docs/scaling.md``, "The claim and the start in
one transaction"):

- The claim holds its row locks and a connection while the worker counts and reserves (tens
  of milliseconds). ``idle_in_transaction_session_timeout`` bounds it at the claim's lease
  TTL: a worker that stalls longer loses the transaction (its session ends), the start fails,
  and the worker releases the leases it took; the items were never touched.
- Other claimers skip the locked items; a cancel or expiry of their job waits for the start
  (it locks them without skipping). The start moves only items whose job is still in
  progress, so a cancel committed meanwhile keeps them from starting: the worker releases
  their leases and the cancel, no longer waiting, ends them.
- Items are locked in id order by every statement that locks many, and the start writes
  nothing but rows it already holds and the counters (in job-id order, as every writer):
  no wait cycle.
- A start whose commit fails, or whose outcome is unknown (the connection dropped), launches
  nothing: the worker releases its leases at once. If the commit did land, the items are
  ``running`` under leases that are gone; no heartbeat extends them and the reaper requeues
  them when they lapse, as any lost attempt.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import namedtuple_row
from sqlalchemy import text

from backfill.states import ITEM_CLAIMABLE, ItemState
from backfill.store.claims import (
    CLAIM_PLANNER,
    HEARTBEAT,
    PICKS,
    claim_statement,
    claimed_item,
    planned_claim,
    share_view,
    start_rows,
)
from backfill.store.counters import counters_cte, moved_from
from backfill.store.database import Database
from backfill.store.driver import array_literal, driver_errors, raw_connection, to_psycopg
from backfill.store.moves import check_moves, in_id_order
from backfill.store.records import ClaimedItem, Start

IDLE = TransactionStatus.IDLE

# The counter moves of a start: each item leaves the state it was picked in, to running
# (started) or reserved (held to be settled); the job's prompt tokens take the exact counts
# the worker had the engine make, in place of what ingest knew (nothing, or a lower bound).
CNT_OPEN_START = counters_cte(
    {s.value: moved_from(s) for s in sorted(ITEM_CLAIMABLE)}
    | {
        "running": "count(*) FILTER (WHERE started)",
        "reserved": "count(*) FILTER (WHERE NOT started)",
        "prompt_tokens": "coalesce(sum(dp), 0)",
    }
)

# Start the picked items with a lease (``:lid`` not NULL) and hold the others, one statement:
# items, counters and each attempt's row (new: the attempt number is new). Only items of a
# job still in progress: a cancel committed since the pick keeps them from starting. Returns
# the ids started.
START_OPEN = (
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), CAST(:att AS int[]), "
    "CAST(:st AS text[]), CAST(:lid AS text[]), CAST(:fen AS bigint[]), CAST(:res AS int[]), "
    "CAST(:pt AS int[]), CAST(:px AS int[])) AS v(id, a, s, l, f, r, p, x)), "
    # The counts before the update (a CTE reads the statement's snapshot).
    "old AS (SELECT i.id, i.prompt_tokens AS p FROM items i JOIN v ON v.id = i.id), "
    "moved AS (UPDATE items i SET "
    "  state = CASE WHEN v.l IS NULL THEN 'reserved' ELSE 'running' END, "
    "  attempt = v.a, node = :node, lease_id = v.l, fencing_token = v.f, not_before = NULL, "
    "  reservation_tokens = coalesce(v.r, i.reservation_tokens), "
    "  prompt_tokens = coalesce(v.p, i.prompt_tokens), "
    "  lease_prefix_tokens = coalesce(v.x, 0), "
    "  lease_expires_at = now() + make_interval(secs => :ttl), "
    "  started_at = CASE WHEN v.l IS NULL THEN i.started_at "
    "    ELSE coalesce(i.started_at, now()) END, "
    "  updated_at = now() "
    "  FROM v JOIN old o ON o.id = v.id "
    "  WHERE i.id = v.id AND i.attempt = v.a - 1 AND i.state = v.s "
    "  AND coalesce((SELECT jb.state = 'in_progress' FROM jobs jb WHERE jb.id = i.job_id), "
    "    false) "
    "  RETURNING i.id, i.job_id, i.attempt, v.l, v.f, v.r, v.p, v.s AS from_state, "
    "    v.l IS NOT NULL AS started, v.p - coalesce(o.p, 0) AS dp), "
    f"{CNT_OPEN_START}, "
    "att AS (INSERT INTO attempts (item_id, attempt, node, lease_id, fencing_token, "
    "  reserved_tokens, prompt_tokens) SELECT id, attempt, :node, l, f, r, p FROM moved) "
    "SELECT id FROM moved WHERE started"
)


@dataclass(slots=True)
class OpenClaim:
    """A claim whose transaction is still open: ``items`` are locked for ``node``, nothing of
    them is written yet. Started (:meth:`Claims.start_claim`) or dropped
    (:meth:`Claims.drop_claim`) once, from any one thread at a time."""

    node: str
    lease_ttl_s: float
    items: list[ClaimedItem]
    _picked_from: dict[int, str] = field(repr=False)
    _fairy: Any = field(repr=False)
    """The pooled connection the transaction runs on; None once started or dropped."""

    @property
    def open(self) -> bool:
        return self._fairy is not None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._fairy is None:
            raise RuntimeError("this claim was already started or dropped")
        conn = self._fairy.driver_connection
        assert isinstance(conn, psycopg.Connection)
        return conn

    def _close(self, *, failed: bool = False) -> None:
        """End the transaction if it is still open (unstarted, it wrote nothing) and give the
        connection back as the pool lent it (autocommit off); a broken one leaves the pool.
        ``failed``: after an error, whose report this must never hide."""
        fairy, self._fairy = self._fairy, None
        if fairy is None:
            return
        conn = fairy.driver_connection
        try:
            if not (conn.closed or conn.broken) and conn.info.transaction_status != IDLE:
                # A rollback that fails leaves nothing behind: the server ends the transaction
                # with the session, and the connection leaves the pool below. What failed
                # before it is the error to report.
                with contextlib.suppress(psycopg.Error):
                    if failed:
                        conn.rollback()
                    else:
                        # Nothing is written before the start (the pick only locks), so a
                        # COMMIT ends an unstarted claim as a rollback would; psycopg forgets a
                        # connection's prepared statements at every ROLLBACK, and the next
                        # claim would parse and plan them all again.
                        conn.execute("COMMIT")
            if not (conn.closed or conn.broken) and conn.info.transaction_status == IDLE:
                conn.autocommit = False
        finally:
            if conn.broken or conn.closed or conn.autocommit:
                fairy.invalidate()
            fairy.close()


class Claims:
    """The worker's claims: items claimed in an open transaction and started in it, their
    heartbeats, and the claim's plan explained (for studies)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def open_claim(
        self,
        node: str,
        limit: int,
        lease_ttl_s: float,
        *,
        models: Sequence[str] | None = None,
        prefix_hold_s: float | None = None,
    ) -> OpenClaim:
        """Pick up to ``limit`` claimable items for ``node`` and keep them locked in an open
        transaction, in the order to start them (see :func:`~backfill.store.claims.planned_claim`
        for the order and ``models``; ``prefix_hold_s``: how long a new job's items are left
        while its prefix pass runs, None: not at all). Each item carries the attempt number its
        start will give it. An empty claim comes back already closed. The transaction ends
        after ``lease_ttl_s`` idle seconds at the latest (the server ends the session)."""
        fairy = raw_connection(self._db.engine)
        claim = OpenClaim(node, lease_ttl_s, [], {}, fairy)
        try:
            conn = claim._connection()
            # The claim's own BEGIN and COMMIT, sent in the pipelines below with its statements:
            # psycopg's implicit BEGIN is a round trip of its own.
            conn.autocommit = True
            with driver_errors():
                cur = conn.cursor(row_factory=namedtuple_row)
                # BEGIN, the settings and the fair share plan's read in one round trip
                # (psycopg's own BEGIN would be a round trip of its own, as each statement).
                with conn.pipeline():
                    conn.execute("BEGIN")
                    conn.execute(
                        "SELECT set_config('idle_in_transaction_session_timeout', %s, true), "
                        f"set_config('synchronous_commit', 'off', true), {CLAIM_PLANNER}",
                        (str(max(int(lease_ttl_s * 1000), 1)),),
                        prepare=True,
                    )
                    if self._db.fair_share:
                        view_statement, view_params = share_view(node, models)
                        cur.execute(to_psycopg(view_statement), view_params, prepare=True)
                view = cur.fetchall() if self._db.fair_share else None
                statement, params = planned_claim(
                    view, node, limit, lease_ttl_s, models, PICKS, prefix_hold_s
                )
                # The pick on its own, not pipelined: the server arms the idle-transaction
                # bound when it reports ready, and disarms it at the next message; psycopg
                # follows a pipeline's sync with a flush, so after a pipeline the bound is off
                # (measured: a claim left open ran on past it; a test pins it).
                rows: list[Any] = cur.execute(
                    to_psycopg(statement), params, prepare=True
                ).fetchall()
        except BaseException:
            claim._close(failed=True)
            raise
        if not rows:
            claim._close()
            return claim
        claim.items = [
            replace(claimed_item(r), prefix_id=r.prefix_id, prefix_blocks=r.prefix_blocks)
            for r in rows
        ]
        claim._picked_from = {r.id: r.from_state for r in rows}
        return claim

    def start_claim(
        self, claim: OpenClaim, starts: Sequence[Start], held: Sequence[tuple[int, int]] = ()
    ) -> list[int]:
        """Start ``claim``: each of ``starts`` (it holds a ledger lease) goes to ``running``
        under its lease and fencing token, each (item_id, attempt) of ``held`` to ``reserved``
        (to be settled by the caller, as a hold), in one statement; the rest of the claim is
        left as it was; the transaction commits. Returns the ids started: a start missing
        from them was not made (its job was cancelled meanwhile) and its lease must be
        released. Raises ``StoreUnavailable`` when the commit fails or its outcome is
        unknown: launch nothing then, and release every lease."""
        check_moves(ITEM_CLAIMABLE, ItemState.RUNNING)
        if not claim.open:
            raise RuntimeError("this claim was already started or dropped")
        rows = start_rows(starts, held)
        unknown = [r[0] for r in rows if r[0] not in claim._picked_from]
        if unknown:
            claim._close()
            raise ValueError(f"items {unknown} are not of this claim")
        if not rows:
            claim._close()
            return []
        ids, att, lid, fen, res, pt = (array_literal(c) for c in zip(*rows, strict=True))
        shared = {s.item_id: s.prefix_tokens for s in starts}
        px = array_literal(shared.get(int(r[0])) for r in rows)
        try:
            conn = claim._connection()
            with driver_errors():
                # The start and the COMMIT in one round trip.
                with conn.pipeline():
                    started = conn.execute(
                        to_psycopg(START_OPEN),
                        {
                            "ids": ids,
                            "att": att,
                            "st": array_literal(claim._picked_from[int(r[0])] for r in rows),
                            "lid": lid,
                            "fen": fen,
                            "res": res,
                            "pt": pt,
                            "px": px,
                            "node": claim.node,
                            "ttl": claim.lease_ttl_s,
                        },
                        prepare=True,
                    )
                    conn.execute("COMMIT")
                applied = [int(r[0]) for r in started.fetchall()]
        except BaseException:
            claim._close(failed=True)
            raise
        claim._close()
        return applied

    def drop_claim(self, claim: OpenClaim) -> None:
        """End ``claim`` writing nothing: its items unlock as they were (no attempt spent)."""
        claim._close()

    def heartbeat(self, held: Sequence[tuple[int, int]], lease_ttl_s: float) -> list[int]:
        """Extend the claims of (item_id, attempt) pairs; returns the ids still held."""
        if not held:
            return []
        held = in_id_order(held, lambda h: h[0])
        with self._db.transaction() as conn:
            return list(
                conn.execute(
                    text(HEARTBEAT),
                    {"t": lease_ttl_s, "ids": [h[0] for h in held], "att": [h[1] for h in held]},
                ).scalars()
            )

    def explain_claim(self, node: str, limit: int, *, models: Sequence[str] | None = None) -> Any:
        """``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`` of the pick an open claim would send
        now, in a transaction rolled back (nothing is locked after it): the plan, for studies
        (``bench.pg_scale``) and the test that pins its shape."""
        with self._db.engine.connect() as conn:
            tx = conn.begin()
            try:
                statement, params = claim_statement(
                    lambda q, p: conn.execute(text(q), p).all(),
                    self._db.fair_share,
                    node,
                    limit,
                    60.0,
                    models,
                    PICKS,
                )
                explain = text("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement)
                plan = conn.execute(explain, params).scalar_one()
            finally:
                tx.rollback()
        return json.loads(plan) if isinstance(plan, str) else plan
