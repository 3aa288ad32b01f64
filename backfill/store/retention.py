"""Retention: a batch that ended long enough ago is purged with everything it left.

A job in a final state (completed, failed, expired, cancelled) whose end is older than the
retention period goes, with its items and their attempts, its events, its webhook events and
deliveries, and its output and error files (rendered from its items, they would be empty
without them). Items go in chunks, each its own short transaction, and a tick does at most so
many rows: a purge never holds locks long, nor a claim up; a job too large for one tick goes
on in the next (past its retention, a job partly purged is no one's business but the purge's).
The input file has its own expiry (``expires_after`` or the default), as at OpenAI.

A summarisation job that ended as long ago goes the same way: its steps, documents and
batch numbers in chunks under the same bound, then its row. Its batches are batches like any
other, ended by the time it ended, and go with the jobs above.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import text

from backfill.states import JOB_TERMINAL
from backfill.store.database import Database
from backfill.summarize.states import SUMMARY_JOB_TERMINAL

ENDED_STATES = ", ".join(f"'{state.value}'" for state in sorted(JOB_TERMINAL))

DUE_JOBS = (
    "SELECT id, output_file_id, error_file_id FROM jobs "
    f"WHERE state IN ({ENDED_STATES}) "
    "AND COALESCE(completed_at, failed_at, expired_at, cancelled_at, created_at) "
    "< now() - make_interval(secs => CAST(:age AS float8)) "
    "ORDER BY COALESCE(completed_at, failed_at, expired_at, cancelled_at, created_at) LIMIT :l"
)
# Attempts, and anything else hanging off an item, go with it (ON DELETE CASCADE).
ITEM_CHUNK = "DELETE FROM items WHERE id IN (SELECT id FROM items WHERE job_id = :j LIMIT :n)"
# Webhook deliveries go with their event; counters and job events with the job.
WEBHOOK_CHUNK = (
    "DELETE FROM webhook_events WHERE id IN "
    "(SELECT id FROM webhook_events WHERE job_id = :j LIMIT :n)"
)
RESULT_FILES = "DELETE FROM files WHERE id = ANY(:ids)"
JOB = "DELETE FROM jobs WHERE id = :j"

SUMMARY_ENDED = ", ".join(f"'{state.value}'" for state in sorted(SUMMARY_JOB_TERMINAL))
DUE_SUMMARY_JOBS = (
    f"SELECT id FROM summary_jobs WHERE state IN ({SUMMARY_ENDED}) "
    "AND COALESCE(ended_at, created_at) < now() - make_interval(secs => CAST(:age AS float8)) "
    "ORDER BY COALESCE(ended_at, created_at) LIMIT :l"
)
SUMMARY_CHUNKS = tuple(
    f"DELETE FROM {table} WHERE ({key}) IN (SELECT {key} FROM {table} WHERE job_id = :j LIMIT :n)"
    for table, key in (
        ("summary_steps", "job_id, seq, node"),
        ("summary_documents", "job_id, seq"),
        ("summary_batches", "job_id, batch_no"),
    )
)
SUMMARY_JOB = "DELETE FROM summary_jobs WHERE id = :j"


@dataclass
class PurgeReport:
    jobs: int = 0
    """Jobs purged whole."""
    rows: int = 0
    """Items and webhook events deleted (attempts and deliveries went with them), and the
    summarisation jobs' steps, documents and batch numbers."""
    summary_jobs: int = 0
    """Summarisation jobs purged whole."""


class Retention:
    def __init__(self, db: Database) -> None:
        self._db = db

    def server_autovacuums(self) -> bool:
        """Whether the Postgres server runs autovacuum: without it (or a scheduled VACUUM) the
        space of purged rows is never reused, and the tables grow by every purged batch."""
        with self._db.transaction() as conn:
            return str(conn.execute(text("SHOW autovacuum")).scalar_one()) == "on"

    def purge_ended_jobs(
        self, older_than_s: float, *, chunk_rows: int = 5000, max_rows: int = 50_000
    ) -> PurgeReport:
        """Purge batches, then summarisation jobs, that ended more than ``older_than_s`` ago,
        ``chunk_rows`` rows per transaction, stopping once ``max_rows`` are gone (the rest in
        the next call)."""
        report = PurgeReport()
        with self._db.transaction() as conn:
            due = conn.execute(text(DUE_JOBS), {"age": older_than_s, "l": 100}).all()
        for job_id, output_file, error_file in due:
            if not self._drain((ITEM_CHUNK, WEBHOOK_CHUNK), job_id, chunk_rows, max_rows, report):
                return report
            with self._db.transaction() as conn:
                files = [f for f in (output_file, error_file) if f is not None]
                if files:
                    conn.execute(text(RESULT_FILES), {"ids": files})
                report.jobs += conn.execute(text(JOB), {"j": job_id}).rowcount or 0
        with self._db.transaction() as conn:
            summary_due = list(
                conn.execute(text(DUE_SUMMARY_JOBS), {"age": older_than_s, "l": 100}).scalars()
            )
        for summary_id in summary_due:
            if not self._drain(SUMMARY_CHUNKS, summary_id, chunk_rows, max_rows, report):
                return report
            with self._db.transaction() as conn:
                gone = conn.execute(text(SUMMARY_JOB), {"j": summary_id}).rowcount
                report.summary_jobs += gone or 0
        return report

    def _drain(
        self,
        chunks: tuple[str, ...],
        job_id: str,
        chunk_rows: int,
        max_rows: int,
        report: PurgeReport,
    ) -> bool:
        """Delete what ``chunks`` select of the job, a chunk per transaction; whether all of
        it went before ``max_rows`` were reached."""
        for chunk in chunks:
            while True:
                if report.rows >= max_rows:
                    return False
                with self._db.transaction() as conn:
                    gone = conn.execute(text(chunk), {"j": job_id, "n": chunk_rows}).rowcount or 0
                report.rows += gone
                if gone < chunk_rows:
                    break
        return True
