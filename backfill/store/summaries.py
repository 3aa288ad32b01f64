"""Summarisation jobs in Postgres: the jobs, their documents, the steps each document makes
and the batches that carry them (the only SQL of ``backfill.summarize``).

A step's key ``(job, document, node)`` is what keeps the reduce driver from making a step
twice: steps are inserted ``ON CONFLICT DO NOTHING``. A batch is numbered within its job and
its steps are tied to it in the transaction that numbers it, so a driver stopped before it
made the batch makes the same batch next time (under the same idempotency key).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, text

from backfill import ids
from backfill.errors import NotFound, StaleWrite
from backfill.store.database import Store
from backfill.summarize.decide import StepView
from backfill.summarize.job_plan import JobShape
from backfill.summarize.prompts import LINE_OVERHEAD
from backfill.summarize.states import DocumentState, StepState, SummaryJobState, sources_of


@dataclass(frozen=True, slots=True)
class SummaryJobRecord:
    id: str
    tenant_id: str
    model: str
    instruction: str
    completion_window: str
    state: SummaryJobState
    shape: JobShape
    fan_in: int
    sampling: dict[str, float]
    forecast_tokens: int
    planned_steps: int
    deadline: datetime | None
    error: str | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None


@dataclass(frozen=True, slots=True)
class NewDocument:
    """A document as it is stored: its row error, or its map steps' request bodies (one per
    chunk)."""

    source_id: str | None
    bodies: Sequence[bytes] = ()
    error: str | None = None
    forecast_tokens: int = 0
    split_depth: int = 0
    planned_steps: int = 0
    """Map and reduce steps it will make."""


@dataclass(frozen=True, slots=True)
class NewStep:
    node: int
    body: bytes


@dataclass(frozen=True, slots=True)
class SummaryCounts:
    documents: dict[DocumentState, int] = field(default_factory=dict)
    steps: dict[StepState, int] = field(default_factory=dict)
    unbatched_steps: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    split_documents: int = 0
    """Documents longer than one prompt, map-reduced."""
    deepest_split: int = 0
    """The most reduce levels one document takes."""


@dataclass(frozen=True, slots=True)
class StepBacklog:
    unbatched: int
    """Pending steps no batch carries yet."""
    waiting: int
    """Pending steps in the job's batches whose items no engine has started (queued, deferred,
    preempted, or not stored yet)."""


@dataclass(frozen=True, slots=True)
class DocumentRow:
    seq: int
    source_id: str | None
    state: DocumentState
    chunks: int
    split_depth: int
    summary: str | None
    error: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class FinishedStep:
    """A pending step whose item ended (``item_state``), or whose batch ended without it
    (``item_state`` None, ``batch_state`` the batch's)."""

    seq: int
    node: int
    item_state: str | None
    batch_state: str
    result: str | None
    error: str | None


_JOB_COLUMNS = (
    "id, tenant_id, model, instruction, completion_window, state, summary_tokens, "
    "context_tokens, map_prompt_tokens, reduce_prompt_tokens, fan_in, sampling, forecast_tokens, "
    "planned_steps, "
    "deadline, error, created_at, started_at, ended_at"
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
# The job row locked for the documents' insert (their numbers follow the last one).
LOCK_RECEIVING = (
    "SELECT coalesce((SELECT max(seq) + 1 FROM summary_documents WHERE job_id = :i), 0) "
    "FROM summary_jobs WHERE id = :i AND state = 'receiving' FOR UPDATE"
)
ADD_FORECAST = (
    "UPDATE summary_jobs SET forecast_tokens = forecast_tokens + :f, "
    "planned_steps = planned_steps + :p WHERE id = :i"
)
INSERT_DOCUMENT = (
    "INSERT INTO summary_documents (job_id, seq, source_id, state, chunks, split_depth, error) "
    "VALUES (:i, :seq, :src, :state, :chunks, :depth, :error)"
)
INSERT_STEP = (
    "INSERT INTO summary_steps (job_id, seq, node, body, line_bytes) "
    "VALUES (:i, :seq, :node, :body, :bytes) ON CONFLICT DO NOTHING"
)
MOVE_JOB = (
    "UPDATE summary_jobs SET state = :to, "
    "deadline = coalesce(:deadline, deadline), error = coalesce(:error, error), "
    "started_at = CASE WHEN :started THEN now() ELSE started_at END, "
    "ended_at = CASE WHEN :ended THEN now() ELSE ended_at END "
    "WHERE id = :i AND state IN :from RETURNING id"
)
OPEN_JOBS = (
    "SELECT id FROM summary_jobs WHERE state IN ('in_progress', 'cancelling') "
    "ORDER BY created_at LIMIT :n"
)
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
# Pending steps whose item ended, or whose batch ended without an item for them.
# The summary jobs that made these batches: by the batch's metadata, confirmed by the job's
# own record of it (a user's batch may carry any metadata), both through primary keys.
JOBS_OF_BATCHES = (
    "SELECT j.id AS batch_id, b.job_id FROM jobs j JOIN summary_batches b "
    "ON b.job_id = j.metadata->>'summary_job' AND b.batch_id = j.id WHERE j.id = ANY(:b)"
)
FINISHED_STEPS = (
    "SELECT s.seq, s.node, i.state AS item_state, j.state AS batch_state, i.result, i.error "
    "FROM summary_steps s "
    "JOIN summary_batches b ON b.job_id = s.job_id AND b.batch_no = s.batch_no "
    "JOIN jobs j ON j.id = b.batch_id "
    "LEFT JOIN items i ON i.job_id = b.batch_id AND i.custom_id = s.seq || ':' || s.node "
    "WHERE s.job_id = :i AND s.state = 'pending' AND ("
    "  i.state IN ('succeeded', 'failed', 'expired', 'cancelled') "
    "  OR (i.id IS NULL AND j.state IN ('failed', 'expired', 'cancelled', 'completed'))"
    ") ORDER BY s.seq, s.node LIMIT :n"
)
END_STEP = (
    "UPDATE summary_steps SET state = :state, summary = :summary, error = :error, "
    "prompt_tokens = :pt, completion_tokens = :ct "
    "WHERE job_id = :i AND seq = :seq AND node = :node AND state = 'pending'"
)
TOUCH_DOCUMENTS = (
    "UPDATE summary_documents SET touched = true WHERE job_id = :i AND state = 'pending' "
    "AND seq = ANY(CAST(:seqs AS int[]))"
)
TOUCHED = (
    "SELECT seq, chunks FROM summary_documents WHERE job_id = :i AND touched ORDER BY seq LIMIT :n"
)
STEPS_OF = (
    "SELECT seq, node, state, summary, error, prompt_tokens, completion_tokens "
    "FROM summary_steps WHERE job_id = :i AND seq = ANY(CAST(:seqs AS int[]))"
)
DECIDED = "UPDATE summary_documents SET touched = false WHERE job_id = :i AND seq = :seq"
END_DOCUMENT = (
    "UPDATE summary_documents SET state = :state, summary = :summary, error = :error, "
    "prompt_tokens = :pt, completion_tokens = :ct, split_depth = :depth, touched = false "
    "WHERE job_id = :i AND seq = :seq AND state = 'pending'"
)
# Pending steps no batch was made for (none numbered, or numbered and not made).
FAIL_UNMADE = (
    "UPDATE summary_steps s SET state = 'failed', error = :error "
    "WHERE s.job_id = :i AND s.state = 'pending' AND (s.batch_no IS NULL OR EXISTS ("
    "  SELECT 1 FROM summary_batches b WHERE b.job_id = s.job_id AND b.batch_no = s.batch_no "
    "  AND b.batch_id IS NULL)) RETURNING s.seq"
)
FAIL_PENDING = (
    "UPDATE summary_documents SET state = 'failed', error = :error, touched = false "
    "WHERE job_id = :i AND state = 'pending'"
)
DOCUMENT_COUNTS = (
    "SELECT state, count(*) AS n, coalesce(sum(prompt_tokens), 0) AS pt, "
    "coalesce(sum(completion_tokens), 0) AS ct, count(*) FILTER (WHERE chunks > 1) AS split, "
    "coalesce(max(split_depth), 0) AS depth FROM summary_documents WHERE job_id = :i "
    "GROUP BY state"
)
STEP_COUNTS = (
    "SELECT state, count(*) AS n, count(*) FILTER (WHERE batch_no IS NULL) AS unbatched "
    "FROM summary_steps WHERE job_id = :i GROUP BY state"
)
DOCUMENT_PAGE = (
    "SELECT seq, source_id, state, chunks, split_depth, summary, error, prompt_tokens, "
    "completion_tokens FROM summary_documents WHERE job_id = :i AND seq > :after "
    "ORDER BY seq LIMIT :n"
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
        error=row.error,
        created_at=row.created_at,
        started_at=row.started_at,
        ended_at=row.ended_at,
    )


class Summaries(Store):
    """Summarisation jobs, their documents, steps and batches."""

    def create_summary_job(
        self,
        tenant_id: str,
        model: str,
        instruction: str,
        window: str,
        shape: JobShape,
        sampling: Mapping[str, float] | None = None,
    ) -> SummaryJobRecord:
        with self._tx() as conn:
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
        with self._tx() as conn:
            row = conn.execute(text(GET_JOB), {"i": job_id}).one_or_none()
        if row is None or (tenant_id is not None and row.tenant_id != tenant_id):
            raise NotFound(f"No such summary job: {job_id}")
        return _job(row)

    def list_summary_jobs(self, tenant_id: str, limit: int = 20) -> list[SummaryJobRecord]:
        """The tenant's newest jobs first."""
        with self._tx() as conn:
            rows = conn.execute(text(LIST_JOBS), {"t": tenant_id, "n": limit}).all()
        return [_job(r) for r in rows]

    def add_documents(self, job_id: str, documents: Sequence[NewDocument]) -> int:
        """Store documents (numbered after those already received) with their map steps;
        returns the number of the first. :class:`StaleWrite` unless the job is receiving."""
        with self._tx() as conn:
            first = conn.execute(text(LOCK_RECEIVING), {"i": job_id}).scalar_one_or_none()
            if first is None:
                raise StaleWrite(f"summary job {job_id} no longer receives documents")
            docs, steps = [], []
            forecast = planned = 0
            for seq, doc in enumerate(documents, start=first):
                forecast += doc.forecast_tokens
                planned += doc.planned_steps
                failed = doc.error is not None
                docs.append(
                    {
                        "i": job_id,
                        "seq": seq,
                        "src": doc.source_id,
                        "state": (DocumentState.FAILED if failed else DocumentState.PENDING),
                        "chunks": max(1, len(doc.bodies)),
                        "depth": doc.split_depth,
                        "error": doc.error,
                    }
                )
                for node, body in enumerate(() if failed else doc.bodies):
                    steps.append(
                        {
                            "i": job_id,
                            "seq": seq,
                            "node": node,
                            "body": body.decode(),
                            "bytes": len(body) + LINE_OVERHEAD,
                        }
                    )
            if docs:
                conn.execute(text(INSERT_DOCUMENT), docs)
            if steps:
                conn.execute(text(INSERT_STEP), steps)
            conn.execute(text(ADD_FORECAST), {"i": job_id, "f": forecast, "p": planned})
        return int(first)

    def move_summary_job(
        self,
        job_id: str,
        to: SummaryJobState,
        *,
        deadline: datetime | None = None,
        error: str | None = None,
    ) -> None:
        """The guarded move of the job to ``to``; :class:`StaleWrite` when it is not in a
        state that moves there."""
        query = text(MOVE_JOB).bindparams(bindparam("from", expanding=True))
        ended = to not in (SummaryJobState.IN_PROGRESS, SummaryJobState.CANCELLING)
        with self._tx() as conn:
            moved = conn.execute(
                query,
                {
                    "i": job_id,
                    "to": to.value,
                    "from": [s.value for s in sources_of(to)],
                    "deadline": deadline,
                    "error": error,
                    "ended": ended,
                    "started": to is SummaryJobState.IN_PROGRESS,
                },
            ).first()
        if moved is None:
            raise StaleWrite(f"summary job {job_id} cannot move to {to.value}")

    def open_summary_jobs(self, limit: int = 100) -> list[str]:
        with self._tx() as conn:
            return list(conn.execute(text(OPEN_JOBS), {"n": limit}).scalars())

    def unbatched_steps(self, job_id: str, limit: int) -> list[tuple[int, int, int]]:
        """``(seq, node, line bytes)`` of steps no batch carries yet, in order."""
        with self._tx() as conn:
            rows = conn.execute(text(UNBATCHED), {"i": job_id, "n": limit}).all()
        return [(r.seq, r.node, r.line_bytes) for r in rows]

    def step_backlog(self, job_id: str) -> StepBacklog:
        """The job's pending steps no batch carries, and those in batches not started yet."""
        with self._tx() as conn:
            row = conn.execute(text(STEP_BACKLOG), {"i": job_id}).one()
        return StepBacklog(int(row.unbatched), max(0, int(row.batched) - int(row.started)))

    def number_batch(self, job_id: str, steps: Sequence[tuple[int, int]]) -> int:
        """A new batch of the job, carrying ``steps`` (their ``(seq, node)``); its number."""
        with self._tx() as conn:
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
        with self._tx() as conn:
            return list(conn.execute(text(BATCHES_TO_MAKE), {"i": job_id}).scalars())

    def batch_steps(
        self, job_id: str, batch_no: int, page: int = 1000
    ) -> Iterator[tuple[int, int, bytes]]:
        """``(seq, node, body)`` of the batch's steps, in order, read a page at a time."""
        after = (-1, -1)
        while True:
            with self._tx() as conn:
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
        with self._tx() as conn:
            conn.execute(text(SET_BATCH), {"i": job_id, "b": batch_no, "bid": batch_id})
            conn.execute(text(DROP_BODIES), {"i": job_id, "b": batch_no})

    def summary_batch_ids(self, job_id: str) -> list[str]:
        with self._tx() as conn:
            return list(conn.execute(text(BATCH_IDS), {"i": job_id}).scalars())

    def summary_jobs_of_batches(self, batch_ids: Sequence[str]) -> dict[str, str]:
        """The summary job of each of ``batch_ids`` that one made (others are left out)."""
        with self._tx() as conn:
            rows = conn.execute(text(JOBS_OF_BATCHES), {"b": list(batch_ids)}).all()
        return {r.batch_id: r.job_id for r in rows}

    def finished_steps(self, job_id: str, limit: int) -> list[FinishedStep]:
        with self._tx() as conn:
            rows = conn.execute(text(FINISHED_STEPS), {"i": job_id, "n": limit}).all()
        return [
            FinishedStep(r.seq, r.node, r.item_state, r.batch_state, r.result, r.error)
            for r in rows
        ]

    def end_steps(self, job_id: str, outcomes: Mapping[tuple[int, int], StepView]) -> None:
        """Record how steps ended and mark their documents for the driver, in one
        transaction (a step already ended is left as it is)."""
        if not outcomes:
            return
        with self._tx() as conn:
            conn.execute(
                text(END_STEP),
                [
                    {
                        "i": job_id,
                        "seq": seq,
                        "node": node,
                        "state": view.state.value,
                        "summary": view.summary,
                        "error": view.error,
                        "pt": view.prompt_tokens,
                        "ct": view.completion_tokens,
                    }
                    for (seq, node), view in outcomes.items()
                ],
            )
            conn.execute(
                text(TOUCH_DOCUMENTS), {"i": job_id, "seqs": sorted({s for s, _ in outcomes})}
            )

    def touched_documents(self, job_id: str, limit: int) -> list[tuple[int, int]]:
        """``(seq, chunks)`` of the documents a step of which ended since the last decision."""
        with self._tx() as conn:
            rows = conn.execute(text(TOUCHED), {"i": job_id, "n": limit}).all()
        return [(r.seq, r.chunks) for r in rows]

    def steps_of(self, job_id: str, seqs: Sequence[int]) -> dict[int, dict[int, StepView]]:
        found: dict[int, dict[int, StepView]] = {seq: {} for seq in seqs}
        with self._tx() as conn:
            rows = conn.execute(text(STEPS_OF), {"i": job_id, "seqs": list(seqs)}).all()
        for r in rows:
            found[r.seq][r.node] = StepView(
                StepState(r.state), r.summary, r.prompt_tokens, r.completion_tokens, r.error
            )
        return found

    def decide_documents(
        self,
        job_id: str,
        new_steps: Mapping[int, Sequence[NewStep]],
        ended: Mapping[int, DocumentRow],
    ) -> None:
        """Apply the driver's decisions in one transaction: the new reduce steps (a step
        made before is not made again), the documents that ended, and every document
        decided on unmarked."""
        with self._tx() as conn:
            steps = [
                {
                    "i": job_id,
                    "seq": seq,
                    "node": s.node,
                    "body": s.body.decode(),
                    "bytes": len(s.body) + LINE_OVERHEAD,
                }
                for seq, made in new_steps.items()
                for s in made
            ]
            if steps:
                conn.execute(text(INSERT_STEP), steps)
            for seq in set(new_steps) - set(ended):
                conn.execute(text(DECIDED), {"i": job_id, "seq": seq})
            for seq, doc in ended.items():
                conn.execute(
                    text(END_DOCUMENT),
                    {
                        "i": job_id,
                        "seq": seq,
                        "state": doc.state.value,
                        "summary": doc.summary,
                        "error": doc.error,
                        "pt": doc.prompt_tokens,
                        "ct": doc.completion_tokens,
                        "depth": doc.split_depth,
                    },
                )

    def fail_unmade_steps(self, job_id: str, error: str) -> int:
        """Fail the pending steps no batch was made for, and mark their documents for the
        driver, in one transaction; returns how many."""
        with self._tx() as conn:
            seqs = list(conn.execute(text(FAIL_UNMADE), {"i": job_id, "error": error}).scalars())
            if seqs:
                conn.execute(text(TOUCH_DOCUMENTS), {"i": job_id, "seqs": sorted(set(seqs))})
        return len(seqs)

    def fail_pending_documents(self, job_id: str, error: str) -> int:
        with self._tx() as conn:
            return conn.execute(text(FAIL_PENDING), {"i": job_id, "error": error}).rowcount

    def summary_counts(self, job_id: str) -> SummaryCounts:
        with self._tx() as conn:
            docs = conn.execute(text(DOCUMENT_COUNTS), {"i": job_id}).all()
            steps = conn.execute(text(STEP_COUNTS), {"i": job_id}).all()
        return SummaryCounts(
            documents={DocumentState(r.state): int(r.n) for r in docs},
            steps={StepState(r.state): int(r.n) for r in steps},
            unbatched_steps=sum(int(r.unbatched) for r in steps),
            prompt_tokens=sum(int(r.pt) for r in docs),
            completion_tokens=sum(int(r.ct) for r in docs),
            split_documents=sum(int(r.split) for r in docs),
            deepest_split=max((int(r.depth) for r in docs), default=0),
        )

    def document_page(self, job_id: str, after_seq: int, limit: int) -> list[DocumentRow]:
        with self._tx() as conn:
            rows = conn.execute(
                text(DOCUMENT_PAGE), {"i": job_id, "after": after_seq, "n": limit}
            ).all()
        return [
            DocumentRow(
                r.seq,
                r.source_id,
                DocumentState(r.state),
                r.chunks,
                r.split_depth,
                r.summary,
                r.error,
                int(r.prompt_tokens),
                int(r.completion_tokens),
            )
            for r in rows
        ]

    @contextmanager
    def driver_lock(self, job_id: str) -> Iterator[bool]:
        """Whether this process holds the job's driver lock (a session advisory lock, held on
        a connection of its own until the block ends): one driver works a job at a time."""
        with self.engine.connect() as conn:
            held = bool(conn.execute(text(DRIVER_LOCK), {"i": job_id}).scalar_one())
            conn.commit()
            try:
                yield held
            finally:
                if held:
                    conn.execute(text(DRIVER_UNLOCK), {"i": job_id})
                    conn.commit()
