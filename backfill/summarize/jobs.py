"""A summarisation job's life as the API serves it: created with its shape, its documents
sent (each split into chunks that fit, through the engine's count), started (admitted on its
whole forecast, as a batch is), watched, cancelled and read back as a dataset.

No HTTP here: the routes (``queue_api/routes/summaries.py``) hand over the tenant, the
engine's numbers and a token count; the reduce driver (:mod:`.driver`) runs the job.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from backfill.batch_ingest import Admission, judge_tokens
from backfill.batches import check_active_limit
from backfill.config import Settings
from backfill.errors import StaleWrite
from backfill.refusals import InvalidRequest, NotCancellable
from backfill.store.protocol import SummaryStore
from backfill.store.records import TenantRecord
from backfill.store.summaries import NewDocument, SummaryCounts, SummaryJobRecord
from backfill.summarize.chunks import ChunkTooSmall, TokenCount, split_counted
from backfill.summarize.documents import MAX_ID_CHARS
from backfill.summarize.job_plan import JobShape
from backfill.summarize.prompts import map_messages, request_body, sampling_problem
from backfill.summarize.reduce_plan import ReduceInfeasible, plan_reduce
from backfill.summarize.states import DocumentState, StepState, SummaryJobState
from backfill.summarize.writer import SummaryRow
from backfill.windows import batch_throughput, checked_window

MAX_INSTRUCTION_CHARS = 4000
MAX_DOCUMENT_CHARS = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class SummaryJobRequest:
    model: str
    instruction: str
    summary_tokens: int
    completion_window: str
    sampling: Mapping[str, float] = field(default_factory=dict)
    """Sampling settings every step gets (``prompts.SAMPLING_BOUNDS``)."""


def check_request(request: SummaryJobRequest, settings: Settings) -> None:
    if not request.model:
        raise InvalidRequest("model is required", param="model")
    if not request.instruction.strip() or len(request.instruction) > MAX_INSTRUCTION_CHARS:
        raise InvalidRequest(
            f"instruction must be 1 to {MAX_INSTRUCTION_CHARS} characters", param="instruction"
        )
    if request.summary_tokens < 1:
        raise InvalidRequest("max_summary_tokens must be positive", param="max_summary_tokens")
    checked_window(
        request.completion_window,
        settings.min_completion_window_s,
        settings.max_completion_window_s,
    )
    problem = sampling_problem(request.sampling)
    if problem is not None:
        raise InvalidRequest(problem, param="sampling")


def create_job(
    repo: SummaryStore,
    settings: Settings,
    tenant: TenantRecord,
    request: SummaryJobRequest,
    shape: JobShape,
) -> SummaryJobRecord:
    """A job receiving documents, refused at once when its shape leaves a chunk no text or
    a reduce fewer than two summaries, or when the tenant is at its active-batch limit (so
    no one sends a corpus to a job that could not start)."""
    check_request(request, settings)
    check_active_limit(repo, settings, tenant.id)
    try:
        shape.check()
    except (ChunkTooSmall, ReduceInfeasible) as exc:
        raise InvalidRequest(str(exc), param="max_summary_tokens") from exc
    return repo.summary_jobs.create_summary_job(
        tenant.id,
        request.model,
        request.instruction,
        request.completion_window,
        shape,
        request.sampling,
    )


def prepare_document(
    job: SummaryJobRecord, source_id: str | None, text: str | None, count: TokenCount
) -> NewDocument:
    """A document as it is stored: its chunks' map lines, its forecast and planned steps;
    or the row error that keeps it from being summarised."""
    if source_id is not None and len(source_id) > MAX_ID_CHARS:
        return NewDocument(source_id[:MAX_ID_CHARS], error="id too long")
    if text is None or not text.strip():
        return NewDocument(source_id, error="empty text")
    if len(text) > MAX_DOCUMENT_CHARS:
        return NewDocument(source_id, error=f"longer than {MAX_DOCUMENT_CHARS} characters")
    shape = job.shape
    counted = split_counted(text, shape.chunk_budget.text_tokens, count)
    chunks, tokens = [c for c, _ in counted], [t for _, t in counted]
    bodies = [
        request_body(
            job.model, map_messages(job.instruction, chunk), shape.summary_tokens, job.sampling
        )
        for chunk in chunks
    ]
    return NewDocument(
        source_id,
        bodies=bodies,
        forecast_tokens=shape.document_tokens(tokens),
        split_depth=plan_reduce(len(chunks), job.fan_in).depth,
        planned_steps=shape.document_steps(len(chunks)),
    )


def add_documents(repo: SummaryStore, job: SummaryJobRecord, documents: list[NewDocument]) -> int:
    """Store documents prepared for ``job``, numbered after those it has (a step's custom id
    is made from its document's number when its batch is)."""
    if job.state is not SummaryJobState.RECEIVING:
        raise StaleWrite(
            f"summary job {job.id} is {job.state.value}: it takes documents only while receiving"
        )
    return repo.summary_jobs.add_documents(job.id, documents)


def start_job(
    repo: SummaryStore,
    settings: Settings,
    tenant: TenantRecord,
    job: SummaryJobRecord,
    *,
    now: datetime | None = None,
) -> SummaryJobRecord:
    """Admit the job on its whole forecast (map steps and every reduce step at its bound)
    and start it under one deadline; :class:`DeadlineInfeasible` leaves it receiving, as
    does :class:`LimitReached`: a started job counts as one of the tenant's active batches
    (the batches it makes do not count: they are its, not the tenant's)."""
    if job.state is not SummaryJobState.RECEIVING:
        return job
    window_s = checked_window(
        job.completion_window, settings.min_completion_window_s, settings.max_completion_window_s
    )
    check_active_limit(repo, settings, tenant.id)
    now = now or repo.now()
    admission = Admission(
        forecast=job.forecast_tokens,
        now=now,
        window_s=window_s,
        throughput_tps=batch_throughput(settings.batch_throughput_tokens_per_s),
        completion_window=job.completion_window,
    )
    judge_tokens(repo, settings, tenant, job.forecast_tokens, admission)
    with contextlib.suppress(StaleWrite):
        repo.summary_jobs.move_summary_job(
            job.id, SummaryJobState.IN_PROGRESS, deadline=now + timedelta(seconds=window_s)
        )
    return repo.summary_jobs.get_summary_job(tenant.id, job.id)


def cancel_job(repo: SummaryStore, tenant: TenantRecord, job_id: str) -> SummaryJobRecord:
    """A receiving job ends cancelled at once; a running one is cancelling until the driver
    has cancelled its batches. What was summarised is kept."""
    job = repo.summary_jobs.get_summary_job(tenant.id, job_id)
    if job.state is SummaryJobState.RECEIVING:
        with contextlib.suppress(StaleWrite):
            repo.summary_jobs.move_summary_job(job.id, SummaryJobState.CANCELLED)
            repo.summary_outcomes.fail_pending_documents(job.id, "cancelled")
    elif job.state is SummaryJobState.IN_PROGRESS:
        with contextlib.suppress(StaleWrite):
            repo.summary_jobs.move_summary_job(job.id, SummaryJobState.CANCELLING)
    elif job.state not in (SummaryJobState.CANCELLING, SummaryJobState.CANCELLED):
        raise NotCancellable(f"cannot cancel a summary job that is {job.state.value}")
    return repo.summary_jobs.get_summary_job(tenant.id, job.id)


@dataclass(frozen=True, slots=True)
class SummaryProgress:
    documents: dict[str, int]
    steps_done: int
    steps_planned: int
    prompt_tokens: int
    completion_tokens: int
    eta: datetime | None
    split_documents: int = 0
    """Documents longer than one prompt, map-reduced."""
    deepest_split: int = 0
    """The most reduce levels one document takes."""


def progress(job: SummaryJobRecord, counts: SummaryCounts, now: datetime) -> SummaryProgress:
    """Documents per state (and how many were split), steps ended of those planned, and an
    ETA from the job's own rate of steps since it started."""
    done = counts.steps.get(StepState.SUCCEEDED, 0) + counts.steps.get(StepState.FAILED, 0)
    planned = max(job.planned_steps, done)
    eta = None
    if job.state is SummaryJobState.IN_PROGRESS and job.started_at is not None and done:
        elapsed = (now - job.started_at).total_seconds()
        eta = now + timedelta(seconds=elapsed * (planned - done) / done)
    return SummaryProgress(
        documents={s.value: counts.documents.get(s, 0) for s in DocumentState},
        steps_done=done,
        steps_planned=planned,
        prompt_tokens=counts.prompt_tokens,
        completion_tokens=counts.completion_tokens,
        eta=eta,
        split_documents=counts.split_documents,
        deepest_split=counts.deepest_split,
    )


def result_rows(repo: SummaryStore, job_id: str, page: int = 1000) -> Iterator[SummaryRow]:
    """The job's documents in source order, as result rows (pending ones without a summary
    yet: results can be read while the job runs)."""
    after = -1
    while True:
        rows = repo.summary_reports.document_page(job_id, after, page)
        for r in rows:
            yield SummaryRow(
                id=r.source_id if r.source_id is not None else f"row {r.seq}",
                summary=r.summary,
                error=r.error if r.state is DocumentState.FAILED else None,
                prompt_tokens=r.prompt_tokens,
                completion_tokens=r.completion_tokens,
                chunks=r.chunks,
                split_depth=r.split_depth,
            )
        if len(rows) < page:
            return
        after = rows[-1].seq
