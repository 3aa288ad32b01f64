"""Held claims: a claim path in two statements, a hold and its commit.

The worker claims through open claims now (``backfill.store.open_claims``: one transaction,
each item written once); holds stay for tools and the fleet benchmark's node, and a worker's
refused items are held the same way (``reserved`` under their attempt) until it settles them.

A **hold** is a claim that opens its attempts at once: one statement picks the claimable
items (fair share between tenants, earliest deadline first within one, ``FOR UPDATE SKIP
LOCKED``), moves them to ``reserved`` under a new attempt number (the fence against any
older attempt) with a lease that lapses after ``lease_ttl_s``, counts them, and writes each
attempt's row. The worker then counts tokens and asks the ledger for leases, and **commits**:
one statement starts the held items it dispatches (``reserved -> running`` with the ledger's
lease id and fencing token; their attempt rows get the lease, a HOT update since migration
0009) and gives back the rest unstarted (``reserved -> queued``, their attempts ended as
released).

What a hold keeps from a plain claim: a held item is ``reserved`` (job status counts it so,
not as ``queued``); a hold never committed lapses with its lease and the reaper queues the
item again, with its attempt ended as lost but not counted as a lost run (it never started:
no fencing token); a cancel ends held items at once like any other unstarted ones, and the
commit then finds them gone and starts nothing (the worker releases the leases it took).
Every write names the attempt, so a hold that lapsed and was taken by another claimer cannot
be committed by the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backfill.states import ItemState
from backfill.store.claims import Claims, claim_statements
from backfill.store.counters import counters_cte
from backfill.store.driver import array_literal, session
from backfill.store.moves import check_moves, in_id_order
from backfill.store.records import ClaimedItem, Start

# The attempt rows a hold opens, one per held item (a new attempt number: none exists yet).
OPEN_ATTEMPTS = (
    "att AS (INSERT INTO attempts (item_id, attempt, node) SELECT id, attempt, :node FROM moved)"
)

# The counter moves of a commit: every committed hold leaves reserved, to running or queued.
CNT_COMMIT = counters_cte(
    {
        "reserved": "-count(*)",
        "running": "count(*) FILTER (WHERE started)",
        "queued": "count(*) FILTER (WHERE NOT started)",
    }
)

# Start the holds with a lease (``:lid`` not NULL) and give back the others, one statement:
# items, counters and attempt rows. Returns the ids started.
COMMIT = (
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
    "CAST(:att AS int[]), CAST(:lid AS text[]), CAST(:fen AS bigint[]), "
    "CAST(:res AS int[]), CAST(:pt AS int[])) AS v(id, a, l, f, r, p)), "
    "moved AS (UPDATE items i SET "
    "  state = CASE WHEN v.l IS NULL THEN 'queued' ELSE 'running' END, "
    "  lease_id = v.l, fencing_token = v.f, "
    "  reservation_tokens = coalesce(v.r, i.reservation_tokens), "
    "  prompt_tokens = coalesce(v.p, i.prompt_tokens), "
    "  lease_expires_at = CASE WHEN v.l IS NULL THEN NULL "
    "    ELSE now() + make_interval(secs => :ttl) END, "
    "  started_at = CASE WHEN v.l IS NULL THEN i.started_at "
    "    ELSE coalesce(i.started_at, now()) END, "
    "  updated_at = now() "
    "  FROM v WHERE i.id = v.id AND i.attempt = v.a AND (i.state = 'reserved') IS TRUE "
    "  RETURNING i.id, i.job_id, i.attempt, i.node, v.l, v.f, v.r, v.p, "
    "    v.l IS NOT NULL AS started), "
    f"{CNT_COMMIT}, "
    # Upserted: a claim made by ``claim()`` (no hold) has no attempt row yet.
    "att AS (INSERT INTO attempts (item_id, attempt, node, lease_id, fencing_token, "
    "  reserved_tokens, prompt_tokens, ended_at, outcome, detail) "
    "  SELECT id, attempt, coalesce(node, ''), l, f, r, p, "
    "    CASE WHEN NOT started THEN now() END, "
    "    CASE WHEN NOT started THEN 'released' END, "
    "    CASE WHEN NOT started THEN CAST(:d AS text) END FROM moved "
    "  ON CONFLICT (item_id, attempt) DO UPDATE SET lease_id = EXCLUDED.lease_id, "
    # The row opened with the hold; the attempt starts now, if it starts.
    "  started_at = CASE WHEN EXCLUDED.lease_id IS NULL THEN attempts.started_at "
    "    ELSE now() END, "
    "  fencing_token = EXCLUDED.fencing_token, reserved_tokens = EXCLUDED.reserved_tokens, "
    "  prompt_tokens = EXCLUDED.prompt_tokens, ended_at = EXCLUDED.ended_at, "
    "  outcome = EXCLUDED.outcome, detail = EXCLUDED.detail) "
    "SELECT id FROM moved WHERE started"
)


# The hold: the claim, with the attempt rows opened in the same statement.
HOLDS = claim_statements(OPEN_ATTEMPTS)


class Holds(Claims):
    """Holding claims and committing them (the worker's claim path)."""

    def hold_claim(
        self,
        node: str,
        limit: int,
        lease_ttl_s: float,
        *,
        models: Sequence[str] | None = None,
    ) -> list[ClaimedItem]:
        """Hold up to ``limit`` claimable items for ``node``, each under a new attempt with
        its row opened, in the order to start them (see :meth:`Claims.claim` for the order
        and ``models``). Until :meth:`commit`, each hold lapses ``lease_ttl_s`` after this
        (or after its last heartbeat), and the reaper queues its item again."""
        with session(self.engine, durable=False) as tx:
            hold, params = self._claim_statement(tx.rows, node, limit, lease_ttl_s, models, HOLDS)
            rows = tx.rows(hold, params)
        return [self._claimed(r) for r in rows]

    def commit(
        self,
        starts: Sequence[Start],
        lease_ttl_s: float,
        *,
        released: Sequence[tuple[int, int]] = (),
        detail: str | None = None,
    ) -> list[int]:
        """Carry a batch of holds out, in one statement: each of ``starts`` (it holds a
        ledger lease) goes ``reserved -> running`` under its lease and fencing token, each
        (item_id, attempt) of ``released`` goes back to the queue unstarted (``detail``: why,
        on its attempt row). Returns the ids started; a start missing from them lost its hold
        meanwhile (cancelled, lapsed and reaped): its lease must be released."""
        check_moves([ItemState.RESERVED], ItemState.RUNNING)
        check_moves([ItemState.RESERVED], ItemState.QUEUED)
        if not starts and not released:
            return []
        ids, att, lid, fen, res, pt = (
            array_literal(c) for c in zip(*start_rows(starts, released), strict=True)
        )
        with session(self.engine, durable=False) as tx:
            return tx.column(
                COMMIT,
                {
                    "ids": ids,
                    "att": att,
                    "lid": lid,
                    "fen": fen,
                    "res": res,
                    "pt": pt,
                    "ttl": lease_ttl_s,
                    "d": detail,
                },
            )


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
