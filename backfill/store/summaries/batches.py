"""The batches that carry a summarisation job's steps to the engines.

A batch is numbered within its job and its steps are tied to it in the transaction that
numbers it, so a driver stopped before it made the batch makes the same batch next time (under
the same idempotency key). Once made, the batch's id is kept and its steps' bodies dropped (the
batch holds them).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from sqlalchemy import text

from backfill.store.database import Database
from backfill.store.summaries.records import StepBacklog

UNBATCHED = (
    "SELECT seq, node, line_bytes FROM summary_steps WHERE job_id = :i AND batch_no IS NULL "
    "ORDER BY seq, node LIMIT :n"
)
NEXT_BATCH = (
    "INSERT INTO summary_batches (job_id, batch_no, steps) "
    "SELECT CAST(:i AS varchar), coalesce(max(batch_no) + 1, 0), :n FROM summary_batches "
    "WHERE job_id = :i "
    "RETURNING batch_no"
)
TIE_STEPS = (
    "UPDATE summary_steps SET batch_no = :b WHERE job_id = :i AND batch_no IS NULL "
    "AND (seq, node) IN (SELECT * FROM unnest(CAST(:seqs AS int[]), CAST(:nodes AS int[])))"
)
# Pending steps no batch carries, and pending steps in batches whose items are not started
# (queued, deferred, preempted, or not stored yet): the work of the job still to reach an engine.
STEP_BACKLOG = (
    "SELECT count(*) FILTER (WHERE batch_no IS NULL) AS unbatched, "
    "count(*) FILTER (WHERE batch_no IS NOT NULL) AS batched, "
    "(SELECT count(*) FROM items i JOIN summary_batches b ON i.job_id = b.batch_id "
    " WHERE b.job_id = :i AND i.state IN ('reserved', 'running')) AS started "
    "FROM summary_steps WHERE job_id = :i AND state = 'pending'"
)
BATCHES_TO_MAKE = (
    "SELECT batch_no FROM summary_batches WHERE job_id = :i AND batch_id IS NULL ORDER BY batch_no"
)
BATCH_LINES = (
    "SELECT seq, node, body FROM summary_steps WHERE job_id = :i AND batch_no = :b "
    "AND (seq, node) > (:s, :n) ORDER BY seq, node LIMIT :lim"
)
SET_BATCH = "UPDATE summary_batches SET batch_id = :bid WHERE job_id = :i AND batch_no = :b"
DROP_BODIES = "UPDATE summary_steps SET body = NULL WHERE job_id = :i AND batch_no = :b"
BATCH_IDS = (
    "SELECT batch_id FROM summary_batches WHERE job_id = :i AND batch_id IS NOT NULL "
    "ORDER BY batch_no"
)
# The summary jobs that made these batches: by the batch's metadata, confirmed by the job's
# own record of it (a user's batch may carry any metadata), both through primary keys.
JOBS_OF_BATCHES = (
    "SELECT j.id AS batch_id, b.job_id FROM jobs j JOIN summary_batches b "
    "ON b.job_id = j.metadata->>'summary_job' AND b.batch_id = j.id WHERE j.id = ANY(:b)"
)


class SummaryBatches:
    """The steps not yet in a batch, the batches numbered and made, and the jobs they belong to."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def unbatched_steps(self, job_id: str, limit: int) -> list[tuple[int, int, int]]:
        """``(seq, node, line bytes)`` of steps no batch carries yet, in order."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(UNBATCHED), {"i": job_id, "n": limit}).all()
        return [(r.seq, r.node, r.line_bytes) for r in rows]

    def step_backlog(self, job_id: str) -> StepBacklog:
        """The job's pending steps no batch carries, and those in batches not started yet."""
        with self._db.transaction() as conn:
            row = conn.execute(text(STEP_BACKLOG), {"i": job_id}).one()
        return StepBacklog(int(row.unbatched), max(0, int(row.batched) - int(row.started)))

    def number_batch(self, job_id: str, steps: Sequence[tuple[int, int]]) -> int:
        """A new batch of the job, carrying ``steps`` (their ``(seq, node)``); its number."""
        with self._db.transaction() as conn:
            batch_no = int(
                conn.execute(text(NEXT_BATCH), {"i": job_id, "n": len(steps)}).scalar_one()
            )
            conn.execute(
                text(TIE_STEPS),
                {
                    "i": job_id,
                    "b": batch_no,
                    "seqs": [s for s, _ in steps],
                    "nodes": [n for _, n in steps],
                },
            )
        return batch_no

    def batches_to_make(self, job_id: str) -> list[int]:
        with self._db.transaction() as conn:
            return list(conn.execute(text(BATCHES_TO_MAKE), {"i": job_id}).scalars())

    def batch_steps(
        self, job_id: str, batch_no: int, page: int = 1000
    ) -> Iterator[tuple[int, int, bytes]]:
        """``(seq, node, body)`` of the batch's steps, in order, read a page at a time."""
        after = (-1, -1)
        while True:
            with self._db.transaction() as conn:
                rows = conn.execute(
                    text(BATCH_LINES),
                    {"i": job_id, "b": batch_no, "s": after[0], "n": after[1], "lim": page},
                ).all()
            for r in rows:
                yield r.seq, r.node, r.body.encode()
            if len(rows) < page:
                return
            after = (rows[-1].seq, rows[-1].node)

    def set_batch(self, job_id: str, batch_no: int, batch_id: str) -> None:
        """The batch is made: its id kept, its steps' bodies dropped (the batch holds them)."""
        with self._db.transaction() as conn:
            conn.execute(text(SET_BATCH), {"i": job_id, "b": batch_no, "bid": batch_id})
            conn.execute(text(DROP_BODIES), {"i": job_id, "b": batch_no})

    def summary_batch_ids(self, job_id: str) -> list[str]:
        with self._db.transaction() as conn:
            return list(conn.execute(text(BATCH_IDS), {"i": job_id}).scalars())

    def summary_jobs_of_batches(self, batch_ids: Sequence[str]) -> dict[str, str]:
        """The summary job of each of ``batch_ids`` that one made (others are left out)."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(JOBS_OF_BATCHES), {"b": list(batch_ids)}).all()
        return {r.batch_id: r.job_id for r in rows}
