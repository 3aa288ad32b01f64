"""Recovery: what the ledger is rebuilt from, the epochs that keep fencing tokens monotonic
across a Redis data loss, and the reaper that takes back items of silent attempts.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import text

from backfill.models import ACTIVE_SQL
from backfill.states import ITEM_ACTIVE, ItemState
from backfill.store.counters import bump_counters
from backfill.store.database import Database
from backfill.store.moves import check_moves
from backfill.store.records import ActiveLeaseRow, LostItem


def active_fields(r: Any) -> dict[str, Any]:
    """ActiveLeaseRow's fields from a ``moved`` row of reap_lost() or end_items()."""
    return {
        "item_id": r.id,
        "node": r.node,
        "attempt": r.attempt,
        "lease_id": r.lease_id,
        "fencing_token": r.fencing_token,
        "reservation_tokens": r.reservation_tokens,
        "lease_expires_at": r.lease_expires_at,
        "deadline": r.deadline,
        "preemptions": r.preemptions,
        "partial_tokens": r.partial_tokens,
    }


def active_row(r: Any) -> ActiveLeaseRow:
    return ActiveLeaseRow(**active_fields(r))


# A ledger epoch larger than any before (one row, bumped per rebuild).
NEXT_LEDGER_EPOCH = (
    "INSERT INTO ledger_epochs (id, epoch) VALUES (1, 1) ON CONFLICT (id) "
    "DO UPDATE SET epoch = ledger_epochs.epoch + 1 RETURNING epoch"
)

# Take back items whose claim expired: requeue, or fail those lost while running as often as the
# cap allows; records each lost attempt.
REAP_LOST = (
    "WITH lost AS (SELECT id, state, node, attempt, lease_id, fencing_token, "
    "  reservation_tokens, lease_expires_at FROM items "
    f"  WHERE state IN ({ACTIVE_SQL}) AND lease_expires_at < now() "
    "  ORDER BY lease_expires_at LIMIT :l FOR UPDATE SKIP LOCKED), "
    "runs AS (SELECT lost.id, (lost.state = 'running')::int + (SELECT count(*) "
    "  FROM attempts a WHERE a.item_id = lost.id AND a.attempt < lost.attempt "
    "  AND a.outcome = 'lost' AND a.fencing_token IS NOT NULL) AS n FROM lost), "
    "fate AS (SELECT lost.*, runs.n AS lost_runs, "
    "  (lost.state = 'running' AND runs.n >= CAST(:cap AS int)) IS TRUE AS failed "
    "  FROM lost JOIN runs ON runs.id = lost.id), "
    "moved AS (UPDATE items i SET "
    "  state = CASE WHEN f.failed THEN 'failed' ELSE 'queued' END, "
    "  error = CASE WHEN f.failed THEN json_build_object('code', 'worker_lost', "
    "    'message', format('worker lost %s times while running this request "
    "(its process died each time); it is not tried again', f.lost_runs))::text "
    "    ELSE i.error END, "
    "  finished_at = CASE WHEN f.failed THEN now() END, "
    "  lease_id = NULL, fencing_token = NULL, lease_expires_at = NULL, "
    "  updated_at = now() "
    "  FROM fate f WHERE i.id = f.id "
    "  RETURNING i.id, i.job_id, i.deadline, i.preemptions, i.partial_tokens, "
    "  f.state AS from_state, f.node, f.attempt, f.lease_id, "
    "  f.fencing_token, f.reservation_tokens, f.lease_expires_at, f.failed, "
    "  f.lost_runs), "
    "att AS (INSERT INTO attempts (item_id, attempt, node, ended_at, outcome, "
    "  detail) SELECT id, attempt, coalesce(node, ''), now(), 'lost', "
    "  CASE WHEN failed THEN format('worker lost %s times', lost_runs) END "
    "  FROM moved ON CONFLICT (item_id, attempt) DO UPDATE SET "
    "  ended_at = now(), outcome = 'lost', detail = EXCLUDED.detail) "
    "SELECT * FROM moved"
)

# Every item a live attempt holds, with its lease fields: what the ledger is rebuilt from.
ACTIVE_LEASES = (
    "SELECT id, node, attempt, lease_id, fencing_token, reservation_tokens, "
    "lease_expires_at, deadline, preemptions, partial_tokens, prefix_id, lease_prefix_tokens "
    f"FROM items WHERE state IN ({ACTIVE_SQL}) ORDER BY id"
)


class Recovery:
    """Ledger epochs, lost attempts, live leases."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def next_ledger_epoch(self) -> int:
        """A ledger epoch larger than any handed out before (fencing tokens stay monotonic
        across a Redis data loss: each rebuild starts a new epoch)."""
        with self._db.transaction() as conn:
            return int(conn.execute(text(NEXT_LEDGER_EPOCH)).scalar_one())

    def reap_lost(self, limit: int = 1000, *, max_lost_runs: int | None = None) -> list[LostItem]:
        """Take back items whose attempt stopped heartbeating; returns them (to release their
        leases).

        An attempt lost while ``running`` means its worker process died with the request in
        the engine, which a poison request can cause every time: with ``max_lost_runs``, an
        item lost that many times while running fails ("worker lost N times") instead of
        being requeued. Attempts lost while ``reserved`` never reached the engine and do not
        count. (Started attempts are the ones whose ``attempts`` row has a fencing token.)
        """
        check_moves(sorted(ITEM_ACTIVE), ItemState.QUEUED)
        check_moves(sorted(ITEM_ACTIVE), ItemState.FAILED)
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(REAP_LOST),
                {"l": limit, "cap": max_lost_runs},
            ).all()
            bump_counters(
                conn,
                [
                    (
                        r.job_id,
                        ItemState(r.from_state),
                        ItemState.FAILED if r.failed else ItemState.QUEUED,
                    )
                    for r in rows
                ],
            )
        return [LostItem(**active_fields(r), failed=r.failed) for r in rows]

    def active_leases(self) -> list[ActiveLeaseRow]:
        """Every item a live attempt holds: what the ledger is rebuilt from."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(ACTIVE_LEASES)).all()
        return [ActiveLeaseRow(*r) for r in rows]
