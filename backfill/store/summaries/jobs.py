"""A summarisation job's life: created, read, its documents received with their map steps, moved
through its states, and driven by one process at a time.

The job row is locked while documents are added, so their numbers follow the last one received
and a job that no longer receives takes none (:class:`~backfill.errors.StaleWrite`). Every move
is guarded by the states it may come from (``backfill.summarize.states``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, text

from backfill import ids
from backfill.errors import NotFound, StaleWrite
from backfill.store.database import Database
from backfill.store.summaries.records import NewDocument, SummaryJobRecord
from backfill.store.summaries.reports import FOLD_COUNTS, FOLD_LOCK
from backfill.summarize.job_plan import JobShape
from backfill.summarize.prompts import LINE_OVERHEAD
from backfill.summarize.states import DocumentState, SummaryJobState, sources_of

_JOB_COLUMNS = (
    "id, tenant_id, model, instruction, completion_window, state, summary_tokens, "
    "context_tokens, map_prompt_tokens, reduce_prompt_tokens, fan_in, sampling, forecast_tokens, "
    "planned_steps, "
    "deadline, documents_open, error, created_at, started_at, ended_at"
)
CREATE_JOB = (
    "INSERT INTO summary_jobs (id, tenant_id, model, instruction, completion_window, "
    "summary_tokens, context_tokens, map_prompt_tokens, reduce_prompt_tokens, fan_in, sampling) "
    f"VALUES (:i, :t, :m, :ins, :w, :s, :c, :mp, :rp, :f, CAST(:samp AS jsonb)) "
    f"RETURNING {_JOB_COLUMNS}"
)
GET_JOB = f"SELECT {_JOB_COLUMNS} FROM summary_jobs WHERE id = :i"
LIST_JOBS = (
    f"SELECT {_JOB_COLUMNS} FROM summary_jobs WHERE tenant_id = :t "
    "ORDER BY created_at DESC LIMIT :n"
)
# The job row locked for the documents' insert (their numbers follow the last one): a job
# receiving, or one started with more documents to come.
LOCK_RECEIVING = (
    "SELECT coalesce((SELECT max(seq) + 1 FROM summary_documents WHERE job_id = :i), 0) "
    "FROM summary_jobs WHERE id = :i "
    "AND (state = 'receiving' OR (state = 'in_progress' AND documents_open)) FOR UPDATE"
)
ADD_FORECAST = (
    "UPDATE summary_jobs SET forecast_tokens = forecast_tokens + :f, "
    "planned_steps = planned_steps + :p WHERE id = :i"
)
# A page's documents and steps in one statement each (the job's counts are kept by a trigger
# a statement: migration 0023_summary_counts).
INSERT_DOCUMENTS = (
    "INSERT INTO summary_documents (job_id, seq, source_id, state, chunks, split_depth, error) "
    "SELECT :i, v.seq, v.src, v.state, v.chunks, v.depth, v.error "
    "FROM unnest(CAST(:seqs AS int[]), CAST(:srcs AS text[]), CAST(:states AS text[]), "
    "CAST(:chunks AS int[]), CAST(:depths AS int[]), CAST(:errors AS text[])) "
    "AS v(seq, src, state, chunks, depth, error)"
)
# A step's key (job, document, node) keeps it from being made twice: the map steps made here,
# the reduce steps by the driver (``outcomes``).
INSERT_STEPS = (
    "INSERT INTO summary_steps (job_id, seq, node, body, line_bytes) "
    "SELECT :i, v.seq, v.node, v.body, v.bytes FROM unnest(CAST(:seqs AS int[]), "
    "CAST(:nodes AS int[]), CAST(:bodies AS text[]), CAST(:bytes AS int[])) "
    "AS v(seq, node, body, bytes) ON CONFLICT DO NOTHING"
)


def steps_params(job_id: str, steps: Sequence[tuple[int, int, bytes]]) -> dict[str, Any]:
    """:data:`INSERT_STEPS`'s parameters for ``(seq, node, body)`` of each step."""
    return {
        "i": job_id,
        "seqs": [seq for seq, _, _ in steps],
        "nodes": [node for _, node, _ in steps],
        "bodies": [body.decode() for _, _, body in steps],
        "bytes": [len(body) + LINE_OVERHEAD for _, _, body in steps],
    }


MOVE_JOB = (
    "UPDATE summary_jobs SET state = :to, "
    "deadline = coalesce(:deadline, deadline), error = coalesce(:error, error), "
    "documents_open = CASE WHEN :started "
    "THEN coalesce(CAST(:open AS boolean), documents_open) ELSE false END, "
    "started_at = CASE WHEN :started THEN now() ELSE started_at END, "
    "ended_at = CASE WHEN :ended THEN now() ELSE ended_at END "
    "WHERE id = :i AND state IN :from RETURNING id"
)
CLOSE_DOCUMENTS = (
    "UPDATE summary_jobs SET documents_open = false WHERE id = :i AND documents_open RETURNING id"
)
OPEN_JOBS = (
    "SELECT id FROM summary_jobs WHERE state IN ('in_progress', 'cancelling') "
    "ORDER BY created_at LIMIT :n"
)
DRIVER_LOCK = "SELECT pg_try_advisory_lock(hashtext('summary:' || :i))"
DRIVER_UNLOCK = "SELECT pg_advisory_unlock(hashtext('summary:' || :i))"


def _job(row: Any) -> SummaryJobRecord:
    return SummaryJobRecord(
        id=row.id,
        tenant_id=row.tenant_id,
        model=row.model,
        instruction=row.instruction,
        completion_window=row.completion_window,
        state=SummaryJobState(row.state),
        shape=JobShape(
            context_tokens=row.context_tokens,
            map_prompt_tokens=row.map_prompt_tokens,
            reduce_prompt_tokens=row.reduce_prompt_tokens,
            summary_tokens=row.summary_tokens,
        ),
        fan_in=row.fan_in,
        sampling=dict(row.sampling or {}),
        forecast_tokens=row.forecast_tokens,
        planned_steps=row.planned_steps,
        deadline=row.deadline,
        documents_open=row.documents_open,
        error=row.error,
        created_at=row.created_at,
        started_at=row.started_at,
        ended_at=row.ended_at,
    )


class SummaryJobs:
    """Summarisation jobs: their rows, the documents they receive, their moves, their driver."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_summary_job(
        self,
        tenant_id: str,
        model: str,
        instruction: str,
        window: str,
        shape: JobShape,
        sampling: Mapping[str, float] | None = None,
    ) -> SummaryJobRecord:
        with self._db.transaction() as conn:
            row = conn.execute(
                text(CREATE_JOB),
                {
                    "i": ids.new_summary_job_id(),
                    "t": tenant_id,
                    "m": model,
                    "ins": instruction,
                    "w": window,
                    "s": shape.summary_tokens,
                    "c": shape.context_tokens,
                    "mp": shape.map_prompt_tokens,
                    "rp": shape.reduce_prompt_tokens,
                    "f": shape.fan_in,
                    "samp": json.dumps(dict(sampling)) if sampling else None,
                },
            ).one()
        return _job(row)

    def get_summary_job(self, tenant_id: str | None, job_id: str) -> SummaryJobRecord:
        with self._db.transaction() as conn:
            row = conn.execute(text(GET_JOB), {"i": job_id}).one_or_none()
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            raise NotFound(f"No such summary job: {job_id}")
        return _job(row)

    def list_summary_jobs(self, tenant_id: str, limit: int = 20) -> list[SummaryJobRecord]:
        """The tenant's newest jobs first."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(LIST_JOBS), {"t": tenant_id, "n": limit}).all()
        return [_job(r) for r in rows]

    def add_documents(self, job_id: str, documents: Sequence[NewDocument]) -> int:
        """Store documents (numbered after those already received) with their map steps;
        returns the number of the first. :class:`StaleWrite` unless the job is receiving, or
        in progress with its documents open."""
        with self._db.transaction() as conn:
            first = conn.execute(text(LOCK_RECEIVING), {"i": job_id}).scalar_one_or_none()
            if first is None:
                raise StaleWrite(f"summary job {job_id} no longer receives documents")
            docs = list(enumerate(documents, start=first))
            steps = [
                (seq, node, body)
                for seq, doc in docs
                if doc.error is None
                for node, body in enumerate(doc.bodies)
            ]
            if docs:
                conn.execute(
                    text(INSERT_DOCUMENTS),
                    {
                        "i": job_id,
                        "seqs": [seq for seq, _ in docs],
                        "srcs": [doc.source_id for _, doc in docs],
                        "states": [
                            (
                                DocumentState.PENDING if doc.error is None else DocumentState.FAILED
                            ).value
                            for _, doc in docs
                        ],
                        "chunks": [max(1, len(doc.bodies)) for _, doc in docs],
                        "depths": [doc.split_depth for _, doc in docs],
                        "errors": [doc.error for _, doc in docs],
                    },
                )
            if steps:
                conn.execute(text(INSERT_STEPS), steps_params(job_id, steps))
            forecast = sum(doc.forecast_tokens for _, doc in docs)
            planned = sum(doc.planned_steps for _, doc in docs)
            conn.execute(text(ADD_FORECAST), {"i": job_id, "f": forecast, "p": planned})
            # The job's counts folded with its page (a job receiving has no driver yet to fold
            # them): its status reads stay a handful of rows however many pages it took.
            conn.execute(text(FOLD_LOCK), {"i": job_id})
            conn.execute(text(FOLD_COUNTS), {"i": job_id})
        return int(first)

    def move_summary_job(
        self,
        job_id: str,
        to: SummaryJobState,
        *,
        deadline: datetime | None = None,
        error: str | None = None,
        documents_open: bool | None = None,
    ) -> None:
        """The guarded move of the job to ``to``; :class:`StaleWrite` when it is not in a
        state that moves there. ``documents_open`` (a move to in progress only) keeps it
        taking documents; any other move closes them."""
        query = text(MOVE_JOB).bindparams(bindparam("from", expanding=True))
        ended = to not in (SummaryJobState.IN_PROGRESS, SummaryJobState.CANCELLING)
        with self._db.transaction() as conn:
            moved = conn.execute(
                query,
                {
                    "i": job_id,
                    "to": to.value,
                    "from": [s.value for s in sources_of(to)],
                    "deadline": deadline,
                    "error": error,
                    "open": documents_open,
                    "ended": ended,
                    "started": to is SummaryJobState.IN_PROGRESS,
                },
            ).first()
        if moved is None:
            raise StaleWrite(f"summary job {job_id} cannot move to {to.value}")

    def close_documents(self, job_id: str) -> bool:
        """The job takes no more documents (waiting for a page being stored, which holds the
        job's row); whether it was open."""
        with self._db.transaction() as conn:
            return conn.execute(text(CLOSE_DOCUMENTS), {"i": job_id}).first() is not None

    def open_summary_jobs(self, limit: int = 100) -> list[str]:
        with self._db.transaction() as conn:
            return list(conn.execute(text(OPEN_JOBS), {"n": limit}).scalars())

    @contextmanager
    def driver_lock(self, job_id: str) -> Iterator[bool]:
        """Whether this process holds the job's driver lock (a session advisory lock, held on
        a connection of its own until the block ends): one driver works a job at a time."""
        with self._db.engine.connect() as conn:
            held = bool(conn.execute(text(DRIVER_LOCK), {"i": job_id}).scalar_one())
            conn.commit()
            try:
                yield held
            finally:
                if held:
                    conn.execute(text(DRIVER_UNLOCK), {"i": job_id})
                    conn.commit()
