"""Retention: a batch that ended long enough ago is purged with everything it left.

A job in a final state (completed, failed, expired, cancelled) whose end is older than the
retention period goes, with its items and their attempts, its events, its webhook events and
deliveries, and its output and error files (rendered from its items, they would be empty
without them). Items go in chunks, each its own short transaction, and a tick runs for at most
so long (``backfill.purge_pace`` sizes each chunk to a target time and stops the tick between
two once its budget is spent): a purge never holds locks long, nor a claim up; a job too large
for one tick goes on in the next (past its retention, a job partly purged is no one's business
but the purge's).
The input file has its own expiry (``expires_after`` or the default), as at OpenAI.

A summarisation job that ended as long ago goes the same way: its steps, documents and
batch numbers in chunks under the same bound, then its row. Its batches are batches like any
other, ended by the time it ended, and go with the jobs above.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from sqlalchemy import text

from backfill.models import JOB_ENDED_AT
from backfill.purge_pace import (
    Chunk,
    NextChunk,
    PurgePace,
    first_chunk,
    next_chunk,
    tick_over,
)
from backfill.states import JOB_TERMINAL
from backfill.store.database import Database
from backfill.summarize.states import SUMMARY_JOB_TERMINAL

ENDED_STATES = ", ".join(f"'{state.value}'" for state in sorted(JOB_TERMINAL))

# The ended jobs past their retention, oldest end first (``ix_jobs_ended``: a month of ended
# jobs is kept, and a tick must not read them all to find a hundred).
DUE_JOBS = (
    "SELECT id, output_file_id, error_file_id FROM jobs "
    f"WHERE state IN ({ENDED_STATES}) "
    f"AND {JOB_ENDED_AT} < now() - make_interval(secs => CAST(:age AS float8)) "
    f"ORDER BY {JOB_ENDED_AT} LIMIT :l"
)


@dataclass(frozen=True)
class KeyChunk:
    """A chunk of one job's rows of ``table`` taken in ``order`` from past the last row the
    chunk before it deleted (the purge's mark): a chunk that looked for "any :n of the job's
    rows" walked every index entry the chunks before it had left dead (until a vacuum, or for
    good while any snapshot older than them is open), so each cost more than the last: 983 ms
    to find 100 items past 170,000 deleted, 0.3 ms this way; a 40,000-document summary job's
    steps and documents, 100 rows a chunk beside an open snapshot, 15.7 s in all."""

    table: str
    rows: str
    """What names a row to delete (its key)."""
    order: tuple[str, ...]
    """The index order the chunks go in (after ``job_id``)."""

    @property
    def sql(self) -> str:
        cols = ", ".join(self.order)
        after = ", ".join(f":after{i}" for i in range(len(self.order)))
        last = ", ".join(f"{c} DESC" for c in self.order)
        return (
            f"WITH gone AS (DELETE FROM {self.table} WHERE ({self.rows}) IN "
            f"(SELECT {self.rows} FROM {self.table} WHERE job_id = :j AND ({cols}) > ({after}) "
            f"ORDER BY {cols} LIMIT :n) RETURNING {cols}) "
            f"SELECT (SELECT count(*) FROM gone), last.* FROM (SELECT 1) AS one "
            f"LEFT JOIN LATERAL (SELECT {cols} FROM gone ORDER BY {last} LIMIT 1) AS last ON true"
        )

    def start(self) -> tuple[int, ...]:
        """Below every row's key (the keys are 4-byte integers)."""
        return (-(2**31),) * len(self.order)


# Attempts, and anything else hanging off an item, go with it (ON DELETE CASCADE).
ITEM_CHUNK = KeyChunk("items", "id", ("line_no",))
# Webhook deliveries go with their event; counters and job events with the job. The events
# need no ``KeyChunk``: a job has at most one (its end; nothing leaves an end state:
# ``test_the_event_exists_exactly_when_the_batch_end_committed``), with a delivery to each of
# at most ``webhooks_max_endpoints`` endpoints, so there is no run of dead index entries for a
# chunk to walk.
WEBHOOK_CHUNK = (
    "DELETE FROM webhook_events WHERE id IN "
    "(SELECT id FROM webhook_events WHERE job_id = :j LIMIT :n)"
)
# Events of no batch (``webhook_endpoint.disabled``) go by age, their deliveries with them
# (ix_webhook_events_unowned_created).
UNOWNED_EVENTS = (
    "DELETE FROM webhook_events WHERE id IN (SELECT id FROM webhook_events "
    "WHERE job_id IS NULL AND created_at < now() - make_interval(secs => CAST(:age AS float8)) "
    "LIMIT :n)"
)
UNOWNED_DUE = (
    "SELECT EXISTS (SELECT 1 FROM webhook_events WHERE job_id IS NULL "
    "AND created_at < now() - make_interval(secs => CAST(:age AS float8)))"
)
RESULT_FILES = "DELETE FROM files WHERE id = ANY(:ids)"
JOB = "DELETE FROM jobs WHERE id = :j"

SUMMARY_ENDED = ", ".join(f"'{state.value}'" for state in sorted(SUMMARY_JOB_TERMINAL))
DUE_SUMMARY_JOBS = (
    f"SELECT id FROM summary_jobs WHERE state IN ({SUMMARY_ENDED}) "
    "AND COALESCE(ended_at, created_at) < now() - make_interval(secs => CAST(:age AS float8)) "
    "ORDER BY COALESCE(ended_at, created_at) LIMIT :l"
)
SUMMARY_CHUNKS = (
    KeyChunk("summary_steps", "job_id, seq, node", ("seq", "node")),
    KeyChunk("summary_documents", "job_id, seq", ("seq",)),
    KeyChunk("summary_batches", "job_id, batch_no", ("batch_no",)),
)
SUMMARY_JOB = "DELETE FROM summary_jobs WHERE id = :j"

DEFAULT_PACE = PurgePace()


@dataclass
class PurgeReport:
    jobs: int = 0
    """Jobs purged whole."""
    rows: int = 0
    """Items and webhook events deleted (attempts and deliveries went with them; events of
    no batch by age), and the summarisation jobs' steps, documents and batch numbers."""
    summary_jobs: int = 0
    """Summarisation jobs purged whole."""
    transactions: int = 0
    """Row-deleting transactions run (each a chunk of one job's rows)."""
    longest_s: float = 0.0
    """The longest of them, in seconds of the clock the purge was given."""
    stopped: str | None = None
    """Why the tick left work to the next (``"budget"``: its time; ``"rows"``: its rows), or
    None when it purged everything due."""


class _Paced:
    """One tick's chunk transactions, sized and stopped by :func:`next_chunk` on ``clock``."""

    def __init__(
        self,
        pace: PurgePace,
        carried: int | None,
        clock: Callable[[], float],
    ) -> None:
        self.pace, self.clock = pace, clock
        self.began = clock()
        self.next = NextChunk(first_chunk(pace, carried))
        self.report = PurgeReport()
        self.jobs_begun = 0

    def drain(
        self, delete: Callable[[KeyChunk | str, int], int], chunks: tuple[KeyChunk | str, ...]
    ) -> bool:
        """Delete what ``chunks`` select of one job, a chunk per transaction (``delete(sql,
        rows)`` runs one and says how many went); whether all of it went before the tick had to
        stop. A tick always begins its first job (so it always gets somewhere), and the next
        ones while its time and rows last."""
        if self.jobs_begun and self.next.stop is None:
            elapsed_s = self.clock() - self.began
            stop = tick_over(self.pace, elapsed_s=elapsed_s, rows_done=self.report.rows)
            self.next = replace(self.next, stop=stop)
        self.jobs_begun += 1
        for chunk in chunks:
            while True:
                if self.next.stop is not None:
                    self.report.stopped = self.next.stop
                    return False
                asked = self.next.rows
                started = self.clock()
                gone = delete(chunk, asked)
                ended = self.clock()
                took = ended - started
                self.report.rows += gone
                self.report.transactions += 1
                self.report.longest_s = max(self.report.longest_s, took)
                self.next = next_chunk(
                    self.pace,
                    Chunk(asked, gone, took),
                    elapsed_s=ended - self.began,
                    rows_done=self.report.rows,
                )
                if gone < asked:
                    break
        return True


class Retention:
    def __init__(self, db: Database) -> None:
        self._db = db
        # The transaction size the last tick ended at: the next one starts there.
        self._purge_rows: int | None = None
        # The job and table whose rows the last chunk deleted, and the last row's key: every
        # row before it is gone (an ended job gets no new rows), so the next chunk starts past.
        self._purge_mark: tuple[str, str, tuple[int, ...]] | None = None

    def server_autovacuums(self) -> bool:
        """Whether the Postgres server runs autovacuum: without it (or a scheduled VACUUM) the
        space of purged rows is never reused, and the tables grow by every purged batch."""
        with self._db.transaction() as conn:
            return str(conn.execute(text("SHOW autovacuum")).scalar_one()) == "on"

    def purge_ended_jobs(
        self,
        older_than_s: float,
        pace: PurgePace = DEFAULT_PACE,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> PurgeReport:
        """Purge batches, then summarisation jobs, that ended more than ``older_than_s`` ago,
        in transactions sized and stopped by ``pace`` as timed on ``clock`` (the rest in the
        next call)."""
        paced = _Paced(pace, self._purge_rows, clock)
        try:
            self._purge(older_than_s, paced)
        finally:
            self._purge_rows = paced.next.rows
        return paced.report

    def _purge(self, older_than_s: float, paced: _Paced) -> None:
        if not self._purge_jobs(older_than_s, paced):
            return
        with self._db.transaction() as conn:
            due = conn.execute(text(UNOWNED_DUE), {"age": older_than_s}).scalar_one()
        if due:  # a look at the index, so a tick with none due reads as one that ended
            paced.drain(self._aged(older_than_s), (UNOWNED_EVENTS,))

    def _aged(self, older_than_s: float) -> Callable[[KeyChunk | str, int], int]:
        def delete(chunk: KeyChunk | str, rows: int) -> int:
            assert isinstance(chunk, str)
            return self._rows_deleted(chunk, {"age": older_than_s, "n": rows})

        return delete

    def _rows_deleted(self, sql: str, params: dict[str, object]) -> int:
        """One chunk's transaction: the rows ``sql`` deleted."""
        with self._db.transaction() as conn:
            return conn.execute(text(sql), params).rowcount or 0

    def _purge_jobs(self, older_than_s: float, paced: _Paced) -> bool:
        """Batches, then summarisation jobs; whether every one due went this tick."""
        report = paced.report
        with self._db.transaction() as conn:
            due = conn.execute(text(DUE_JOBS), {"age": older_than_s, "l": 100}).all()
        for job_id, output_file, error_file in due:
            if not paced.drain(self._deleter(job_id), (ITEM_CHUNK, WEBHOOK_CHUNK)):
                return False
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
            if not paced.drain(self._deleter(summary_id), SUMMARY_CHUNKS):
                return False
            with self._db.transaction() as conn:
                gone = conn.execute(text(SUMMARY_JOB), {"j": summary_id}).rowcount
                report.summary_jobs += gone or 0
        return True

    def _deleter(self, job_id: str) -> Callable[[KeyChunk | str, int], int]:
        def delete(chunk: KeyChunk | str, rows: int) -> int:
            if isinstance(chunk, str):
                return self._rows_deleted(chunk, {"j": job_id, "n": rows})
            mark = self._purge_mark
            if mark is not None and mark[:2] == (job_id, chunk.table):
                after = mark[2]  # past the last row this job's chunks of the table deleted
            else:
                after = chunk.start()
            params: dict[str, object] = {"j": job_id, "n": rows}
            params.update({f"after{i}": v for i, v in enumerate(after)})
            with self._db.transaction() as conn:
                gone, *last = conn.execute(text(chunk.sql), params).one()
            if last[0] is not None:
                self._purge_mark = (job_id, chunk.table, tuple(int(v) for v in last))
            return int(gone)

        return delete
