"""Jobs (batches): creation with idempotency keys, reads with their counters, guarded state
transitions with an event per move, and the maintenance queries that move jobs on.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from psycopg.types.json import Jsonb
from sqlalchemy import Connection, text

from backfill import ids
from backfill.errors import IllegalTransition, NotFound, StaleWrite
from backfill.states import ITEM_TERMINAL, JOB_TRANSITIONS, ItemState, JobState
from backfill.store.counters import COUNTED_STATES, COUNTERS_JOIN
from backfill.store.database import Database
from backfill.store.records import JobCounts, JobRecord
from backfill.webhooks.outbox import enqueue_batch_event

# The column each job state stamps when a job enters it.
JOB_TIMESTAMP = {
    JobState.IN_PROGRESS: "in_progress_at",
    JobState.FINALIZING: "finalizing_at",
    JobState.COMPLETED: "completed_at",
    JobState.FAILED: "failed_at",
    JobState.EXPIRED: "expired_at",
    JobState.CANCELLING: "cancelling_at",
    JobState.CANCELLED: "cancelled_at",
}

# The columns of a JobRecord, in the order job_from_row reads them (jobs j, counters c).
JOB_COLUMNS = (
    "j.id, j.tenant_id, j.input_file_id, j.endpoint, j.model, j.completion_window, j.state, "
    "j.deadline, j.metadata, j.errors, j.idempotency_key, j.output_file_id, j.error_file_id, "
    "j.created_at, j.in_progress_at, j.finalizing_at, j.completed_at, j.failed_at, "
    "j.expired_at, j.cancelling_at, j.cancelled_at, c.total, "
    + ", ".join(f"c.{s.value}" for s in COUNTED_STATES)
    + ", c.prompt_tokens, c.max_output_tokens, c.output_tokens, c.input_tokens"
)

# Lock the job, move it if its state is a source of the target, return the state it left.
# (SET is built per call: the timestamp and the optional columns vary.)
MOVE_JOB = (
    "WITH old AS (SELECT id, state FROM jobs WHERE id = :i FOR NO KEY UPDATE) "
    "UPDATE jobs j SET {sets} FROM old "
    "WHERE j.id = old.id AND old.state = ANY(:src) RETURNING old.state"
)
# The state a refused move found (NULL: no such job).
JOB_STATE = "SELECT state FROM jobs WHERE id = :i"
# The event of one job move, with its reason.
JOB_EVENT = "INSERT INTO job_events (job_id, from_state, to_state, reason) VALUES (:i, :f, :t, :r)"


def job_from_row(row: Sequence[Any]) -> JobRecord:
    stamps = dict(zip(JOB_TIMESTAMP.values(), row[14:21], strict=True))
    n = len(COUNTED_STATES)
    counts = JobCounts(
        total=row[21] or 0,
        by_state={s: (row[22 + i] or 0) for i, s in enumerate(COUNTED_STATES)},
        prompt_tokens=row[22 + n] or 0,
        max_output_tokens=row[23 + n] or 0,
        output_tokens=row[24 + n] or 0,
        input_tokens=row[25 + n] or 0,
    )
    return JobRecord(
        id=row[0],
        tenant_id=row[1],
        input_file_id=row[2],
        endpoint=row[3],
        model=row[4],
        completion_window=row[5],
        state=JobState(row[6]),
        deadline=row[7],
        metadata=row[8],
        errors=row[9],
        idempotency_key=row[10],
        output_file_id=row[11],
        error_file_id=row[12],
        created_at=row[13],
        timestamps=stamps,
        counts=counts,
    )


def move_job(
    conn: Connection,
    job_id: str,
    target: JobState,
    *,
    reason: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    output_file_id: str | None = None,
    error_file_id: str | None = None,
) -> JobState:
    """``Repository.jobs.move_job`` inside the caller's transaction.

    The job row is locked ``FOR NO KEY UPDATE``: transitions of one job queue behind each
    other, but not behind a create that is storing the job's items (it holds the row
    ``FOR KEY SHARE`` for as long as it writes; see ``insert_items``)."""
    sources = [s.value for s, nexts in JOB_TRANSITIONS.items() if target in nexts]
    stamp = JOB_TIMESTAMP.get(target)
    sets = ["state = :to"]
    if stamp:
        sets.append(f"{stamp} = now()")
    params: dict[str, Any] = {"i": job_id, "to": target.value, "src": sources}
    if errors is not None:
        sets.append("errors = :errors")
        params["errors"] = Jsonb(errors)
    if output_file_id is not None:
        sets.append("output_file_id = :of")
        params["of"] = output_file_id
    if error_file_id is not None:
        sets.append("error_file_id = :ef")
        params["ef"] = error_file_id
    row = conn.execute(text(MOVE_JOB.format(sets=", ".join(sets))), params).first()
    if row is None:
        current = conn.execute(text(JOB_STATE), {"i": job_id}).scalar()
        if current is None:
            raise NotFound(f"No such Batch object: {job_id}")
        raise StaleWrite(f"job {job_id} is {current}; cannot move to {target}")
    conn.execute(text(JOB_EVENT), {"i": job_id, "f": row[0], "t": target.value, "r": reason})
    enqueue_batch_event(conn, job_id, target)
    return JobState(row[0])


# A new job unless the tenant already made one with this idempotency key (then nothing).
CREATE_JOB = (
    "INSERT INTO jobs (id, tenant_id, input_file_id, endpoint, model, "
    "completion_window, state, deadline, metadata, idempotency_key, output_expires_after_s, "
    "ingest_deferred, ingest_turn) VALUES (:i, :t, :f, :e, :m, :w, :s, :d, :md, :k, :x, :g, "
    "CASE WHEN :g THEN 1 + (SELECT count(*) FROM jobs q "
    "WHERE q.tenant_id = CAST(:t AS varchar) AND q.state = 'validating' "
    "AND q.ingest_deferred) ELSE 0 END) "
    "ON CONFLICT (tenant_id, idempotency_key) "
    "WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id"
)

# The job an earlier create with the same key made.
JOB_BY_IDEMPOTENCY_KEY = "SELECT id FROM jobs WHERE tenant_id = :t AND idempotency_key = :k"

# A new job's first event: its creation in its first state.
FIRST_JOB_EVENT = "INSERT INTO job_events (job_id, to_state) VALUES (:i, :s)"

# One job with its summed counters; the tenant check is skipped for internal callers (NULL).
GET_JOB = (
    f"SELECT {JOB_COLUMNS} FROM jobs j {COUNTERS_JOIN} "
    "WHERE j.id = :i AND (CAST(:t AS text) IS NULL OR j.tenant_id = :t)"
)

# A page of the tenant's jobs, newest first, after the job named by the cursor.
LIST_JOBS = (
    f"SELECT {JOB_COLUMNS} FROM jobs j {COUNTERS_JOIN} "
    "WHERE j.tenant_id = :t AND (CAST(:a AS text) IS NULL OR "
    "(j.created_at, j.id) < (SELECT created_at, id FROM jobs "
    "WHERE id = :a AND tenant_id = :t)) "
    "ORDER BY j.created_at DESC, j.id DESC LIMIT :l"
)

# The tenant's jobs not yet ended (the API's cap on open jobs).
# What counts against the tenant's active-batch limit: its batches, less those a
# summarisation job of its made (known by the idempotency key the driver gives them, which
# names the job and the batch's number, from before the batch exists), and each of its
# summarisation jobs started and not ended, as one.
COUNT_ACTIVE_JOBS = (
    "SELECT (SELECT count(*) FROM jobs j WHERE j.tenant_id = :t AND j.state IN "
    "('validating', 'in_progress', 'finalizing', 'cancelling') AND NOT EXISTS ("
    "  SELECT 1 FROM summary_batches b JOIN summary_jobs s ON s.id = b.job_id "
    "  WHERE s.tenant_id = :t AND b.job_id = split_part(j.idempotency_key, ':batch:', 1) "
    "  AND CAST(b.batch_no AS text) = split_part(j.idempotency_key, ':batch:', 2))) "
    "+ (SELECT count(*) FROM summary_jobs WHERE tenant_id = :t "
    "   AND state IN ('in_progress', 'cancelling'))"
)

# Worst-case tokens of the tenant's unfinished items, pro rata from the counters (the quota check).
ENQUEUED_TOKENS = (
    "SELECT coalesce(sum((c.prompt_tokens + c.max_output_tokens) "
    "* (c.total - c.succeeded - c.failed - c.expired - c.cancelled) "
    "/ greatest(c.total, 1)), 0) FROM jobs j "
    f"{COUNTERS_JOIN} WHERE j.tenant_id = :t "
    "AND j.state IN ('validating', 'in_progress', 'cancelling')"
)

# A tenant's deferred creates still validating (waiting for an ingest or in one).
DEFERRED_CREATES = (
    "SELECT count(*) FROM jobs WHERE tenant_id = :t AND state = 'validating' AND ingest_deferred"
)

# A job's audit trail, in order.
JOB_EVENTS = "SELECT from_state, to_state, reason FROM job_events WHERE job_id = :i ORDER BY id"

# Jobs in one state, earliest deadline first (maintenance passes).
JOBS_IN_STATE = "SELECT id FROM jobs WHERE state = :s ORDER BY deadline LIMIT :l"

# Running or validating jobs whose deadline has passed, on the database clock (expiry).
JOBS_PAST_DEADLINE = (
    "SELECT id FROM jobs WHERE state IN ('validating', 'in_progress') "
    "AND deadline <= now() ORDER BY deadline LIMIT :l"
)

# Move on stale validating jobs whose create died: in_progress if their items are stored, else
# failed; skips live creates.
RECOVER_VALIDATING = (
    "WITH stale AS (SELECT j.id, EXISTS (SELECT 1 FROM items i "
    "  WHERE i.job_id = j.id) AS stored FROM jobs j "
    "  WHERE j.state = 'validating' AND NOT j.ingest_deferred AND j.created_at < :before "
    "  ORDER BY j.created_at LIMIT :l FOR UPDATE OF j SKIP LOCKED), "
    "moved AS (UPDATE jobs j SET "
    "  state = CASE WHEN s.stored THEN 'in_progress' ELSE 'failed' END, "
    "  in_progress_at = CASE WHEN s.stored THEN now() END, "
    "  failed_at = CASE WHEN s.stored THEN NULL ELSE now() END, "
    "  errors = CASE WHEN s.stored THEN j.errors ELSE :errors END "
    "  FROM stale s WHERE j.id = s.id RETURNING j.id, j.state), "
    "ev AS (INSERT INTO job_events (job_id, from_state, to_state, reason) "
    "  SELECT id, 'validating', state, 'recovered from validating' FROM moved) "
    "SELECT id, state FROM moved"
)

# The job a tenant already created with this key (a retried create).
JOB_FOR_IDEMPOTENCY_KEY = "SELECT id FROM jobs WHERE tenant_id = :t AND idempotency_key = :k"

# Running or finalizing jobs with no unfinished item, asked of the items (not the counters).
JOBS_READY_TO_FINALIZE = (
    "SELECT j.id FROM jobs j WHERE j.state IN ('in_progress', 'finalizing') "
    "AND NOT EXISTS (SELECT 1 FROM items i WHERE i.job_id = j.id "
    "AND i.state = ANY(:u)) ORDER BY j.deadline LIMIT :l"
)


class Jobs:
    """Jobs and their transitions."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_job(
        self,
        tenant_id: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        deadline: datetime,
        *,
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        model: str | None = None,
        state: JobState = JobState.VALIDATING,
        output_expires_after_s: int | None = None,
        ingest_deferred: bool = False,
    ) -> JobRecord:
        """A new job with its counters row. Reusing an idempotency key returns the first job.
        ``ingest_deferred``: an ingest process is to check and store its items."""
        job_id = ids.new_job_id()
        with self._db.transaction() as conn:
            inserted = conn.execute(
                text(CREATE_JOB),
                {
                    "i": job_id,
                    "t": tenant_id,
                    "f": input_file_id,
                    "e": endpoint,
                    "m": model,
                    "w": completion_window,
                    "s": state.value,
                    "d": deadline,
                    "md": Jsonb(metadata) if metadata is not None else None,
                    "k": idempotency_key,
                    "x": output_expires_after_s,
                    "g": ingest_deferred,
                },
            ).first()
            if inserted is None:
                existing = conn.execute(
                    text(JOB_BY_IDEMPOTENCY_KEY),
                    {"t": tenant_id, "k": idempotency_key},
                ).scalar_one()
                job_id = existing
            else:
                conn.execute(
                    text(FIRST_JOB_EVENT),
                    {"i": job_id, "s": state.value},
                )
            # Read back in the same transaction: one round trip and commit fewer per create.
            row = conn.execute(text(GET_JOB), {"i": job_id, "t": tenant_id}).first()
        if row is None:
            raise NotFound(f"No such Batch object: {job_id}")
        return job_from_row(row)

    def get_job(self, tenant_id: str | None, job_id: str) -> JobRecord:
        """The job with its counters; ``tenant_id=None`` only for internal callers."""
        with self._db.transaction() as conn:
            row = conn.execute(
                text(GET_JOB),
                {"i": job_id, "t": tenant_id},
            ).first()
        if row is None:
            raise NotFound(f"No such Batch object: {job_id}")
        return job_from_row(row)

    def list_jobs(
        self, tenant_id: str, *, after: str | None = None, limit: int = 20
    ) -> list[JobRecord]:
        """Newest first; ``after`` is the id of the last job of the previous page."""
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(LIST_JOBS),
                {"t": tenant_id, "a": after, "l": limit},
            ).all()
        return [job_from_row(r) for r in rows]

    def count_active_jobs(self, tenant_id: str) -> int:
        with self._db.transaction() as conn:
            return int(
                conn.execute(
                    text(COUNT_ACTIVE_JOBS),
                    {"t": tenant_id},
                ).scalar_one()
            )

    def deferred_creates(self, tenant_id: str) -> int:
        """The tenant's creates waiting for an ingest process or in one."""
        with self._db.transaction() as conn:
            return int(conn.execute(text(DEFERRED_CREATES), {"t": tenant_id}).scalar_one())

    def enqueued_tokens(self, tenant_id: str) -> int:
        """Worst-case tokens (prompt + max output) of the tenant's unfinished items."""
        with self._db.transaction() as conn:
            return int(
                conn.execute(
                    text(ENQUEUED_TOKENS),
                    {"t": tenant_id},
                ).scalar_one()
            )

    def move_job(
        self,
        job_id: str,
        target: JobState,
        *,
        reason: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        output_file_id: str | None = None,
        error_file_id: str | None = None,
    ) -> JobState:
        """Guarded job transition; returns the state it left. ``StaleWrite`` if not allowed now."""
        with self._db.transaction() as conn:
            return move_job(
                conn,
                job_id,
                target,
                reason=reason,
                errors=errors,
                output_file_id=output_file_id,
                error_file_id=error_file_id,
            )

    def job_events(self, job_id: str) -> list[tuple[str | None, str, str | None]]:
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(JOB_EVENTS),
                {"i": job_id},
            ).all()
        return [(r[0], r[1], r[2]) for r in rows]

    def jobs_in_state(self, state: JobState, limit: int = 100) -> list[str]:
        with self._db.transaction() as conn:
            return list(
                conn.execute(
                    text(JOBS_IN_STATE),
                    {"s": state.value, "l": limit},
                ).scalars()
            )

    def jobs_past_deadline(self, limit: int = 100) -> list[str]:
        with self._db.transaction() as conn:
            return list(
                conn.execute(
                    text(JOBS_PAST_DEADLINE),
                    {"l": limit},
                ).scalars()
            )

    def recover_validating(
        self, created_before: datetime, errors: list[dict[str, Any]], limit: int = 100
    ) -> dict[str, JobState]:
        """Move on the ``validating`` jobs created before ``created_before`` whose create is
        gone (its API process died): a job whose items are stored goes on to
        ``in_progress`` (the COPY is all or nothing, so they are all there), any other
        fails with ``errors``. A deferred create is left to the ingest processes (an ingest
        that dies is begun again). A live create holds its job's row for as long as it stores
        (see ``insert_items``), so ``SKIP LOCKED`` leaves it alone however long it takes;
        and one that somehow resumes later finds its job moved and stores nothing."""
        for target in (JobState.IN_PROGRESS, JobState.FAILED):
            if target not in JOB_TRANSITIONS[JobState.VALIDATING]:
                raise IllegalTransition(f"job validating -> {target} is not in the state machine")
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(RECOVER_VALIDATING),
                {"before": created_before, "l": limit, "errors": Jsonb(errors)},
            ).all()
            for job_id, state in rows:
                # A failed batch is an end its webhooks hear of, in this same transaction.
                enqueue_batch_event(conn, job_id, JobState(state))
        return {r[0]: JobState(r[1]) for r in rows}

    def job_id_for_idempotency_key(self, tenant_id: str, idempotency_key: str) -> str | None:
        """The job a tenant already created with this key, if any (a retried create)."""
        with self._db.transaction() as conn:
            return conn.execute(
                text(JOB_FOR_IDEMPOTENCY_KEY),
                {"t": tenant_id, "k": idempotency_key},
            ).scalar()

    def jobs_with_all_items_finished(self, limit: int = 100) -> list[str]:
        """In-progress or finalizing jobs none of whose items is unfinished: ready to finalize.

        Asks the items (through the ``(job_id, state)`` index) rather than the counters, so a
        job is never finalized on a counter that drifted."""
        unfinished = [s.value for s in ItemState if s not in ITEM_TERMINAL]
        with self._db.transaction() as conn:
            return list(
                conn.execute(
                    text(JOBS_READY_TO_FINALIZE),
                    {"u": unfinished, "l": limit},
                ).scalars()
            )
