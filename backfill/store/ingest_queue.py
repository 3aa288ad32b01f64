"""The ingest processes' queue: deferred creates still ``validating``, each taken by one
ingest process at a time.

An ingest takes its job with a session advisory lock on a connection of its own, held for as
long as it works (checking the file and the COPY of its items can take minutes): a second
ingest process skips a job so held, and if the process dies its connection closes, the lock
goes with it, and the job is taken again (the COPY is all or nothing, so nothing of the first
ingest was stored). Each take counts in ``ingest_attempts``. Tenants take turns: a create
made while k of its tenant's wait has turn k + 1 (``ingest_turn``), and the queue goes by
turn, then age, so one tenant's thirty large files do not hold another's one.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import text

from backfill.store.database import Database

# Deferred creates waiting whose file's size is in (:lo, :hi], tenants in turn (each
# tenant's oldest first).
INGEST_CANDIDATES = (
    "SELECT j.id FROM jobs j JOIN files f ON f.id = j.input_file_id "
    "WHERE j.state = 'validating' AND j.ingest_deferred AND f.bytes > :lo AND f.bytes <= :hi "
    "ORDER BY j.ingest_turn, j.created_at, j.id LIMIT :l"
)
ANY_SIZE = (-1, 2**62)

# The advisory lock that says a job is being ingested (session-level: held across the
# ingest's transactions, gone with its connection).
TRY_LOCK = "SELECT pg_try_advisory_lock(hashtextextended('backfill.ingest:' || :i, 0))"
UNLOCK = "SELECT pg_advisory_unlock(hashtextextended('backfill.ingest:' || :i, 0))"

# One more ingest of a job still waiting for one; its count.
BEGIN_INGEST = (
    "UPDATE jobs SET ingest_attempts = ingest_attempts + 1 "
    "WHERE id = :i AND state = 'validating' AND ingest_deferred RETURNING ingest_attempts"
)

# How many deferred creates wait, and the oldest one's age in seconds (for the metrics).
INGEST_BACKLOG = (
    "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0) FROM jobs "
    "WHERE state = 'validating' AND ingest_deferred"
)


@dataclass(frozen=True, slots=True)
class IngestTake:
    """One ingest's hold on a deferred create: the job, and which ingest of it this is
    (from 1)."""

    job_id: str
    attempt: int


class IngestQueue:
    """Deferred creates, taken one at a time."""

    def __init__(self, db: Database) -> None:
        self._db = db

    @contextmanager
    def take_deferred_ingest(
        self, *, scan: int = 16, sizes: tuple[int, int] = ANY_SIZE
    ) -> Iterator[IngestTake | None]:
        """The next deferred create no other ingest holds whose file's size in bytes is in
        ``sizes`` (above the first, at most the second), held until the block ends (None:
        none waits). The hold is a lock of the connection's session, so it lasts across the
        ingest's own transactions and ends if this process dies."""
        params = {"l": scan, "lo": sizes[0], "hi": sizes[1]}
        with self._db.engine.connect() as raw:
            conn = raw.execution_options(isolation_level="AUTOCOMMIT")
            taken: IngestTake | None = None
            try:
                for job_id in conn.execute(text(INGEST_CANDIDATES), params).scalars():
                    if not conn.execute(text(TRY_LOCK), {"i": job_id}).scalar_one():
                        continue
                    # Held now; it may have been ingested between the scan and the lock.
                    attempt = conn.execute(text(BEGIN_INGEST), {"i": job_id}).scalar()
                    if attempt is None:
                        conn.execute(text(UNLOCK), {"i": job_id})
                        continue
                    taken = IngestTake(job_id, int(attempt))
                    break
                yield taken
            finally:
                if taken is not None:
                    try:
                        conn.execute(text(UNLOCK), {"i": taken.job_id})
                    except Exception:
                        # Never back to the pool still holding the lock: closing the
                        # connection ends its session, and the lock with it.
                        raw.invalidate()
                        raise

    def ingest_backlog(self) -> tuple[int, float]:
        """Deferred creates waiting (or being ingested), and the oldest one's age in
        seconds."""
        with self._db.transaction() as conn:
            row = conn.execute(text(INGEST_BACKLOG)).one()
        return int(row[0]), float(row[1])
