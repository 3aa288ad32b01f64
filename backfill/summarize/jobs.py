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
from backfill.refusals import DeadlineInfeasible, InvalidRequest, NotCancellable
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


def takes_documents(job: SummaryJobRecord) -> bool:
    """Receiving, or started with more documents to come."""
    return job.state is SummaryJobState.RECEIVING or (
        job.state is SummaryJobState.IN_PROGRESS and job.documents_open
    )


def add_documents(
    repo: SummaryStore,
    settings: Settings,
    tenant: TenantRecord,
    job: SummaryJobRecord,
    documents: list[NewDocument],
) -> int:
    """Store documents prepared for ``job``, numbered after those it has (a step's custom id
    is made from its document's number when its batch is). A job already running judges
    them first, as a batch of their forecast under what is left of its window: a page that
    cannot finish by the job's deadline is refused whole (:class:`DeadlineInfeasible`), and
    what the job took before runs on."""
    if not takes_documents(job):
        raise StaleWrite(
            f"summary job {job.id} is {job.state.value}: it takes documents only while "
            "receiving, or started with more_documents and not closed"
        )
    if job.state is SummaryJobState.IN_PROGRESS:
        _judge_page(repo, settings, tenant, job, sum(d.forecast_tokens for d in documents))
    return repo.summary_jobs.add_documents(job.id, documents)


def _judge_page(
    repo: SummaryStore,
    settings: Settings,
    tenant: TenantRecord,
    job: SummaryJobRecord,
    tokens: int,
) -> None:
    assert job.deadline is not None, "a job in progress has a deadline"
    now = repo.now()
    left_s = int((job.deadline - now).total_seconds())
    if tokens <= 0:
        return
    admission = Admission(
        forecast=tokens,
        now=now,
        window_s=max(0, left_s),
        throughput_tps=batch_throughput(settings.batch_throughput_tokens_per_s),
        completion_window=job.completion_window,
    )
    try:
        judge_tokens(repo, settings, tenant, tokens, admission)
    except DeadlineInfeasible as exc:
        raise DeadlineInfeasible(
            f"these documents cannot be summarised by the job's deadline ({left_s} s from "
            f"now): with the current backlog they would finish about "
            f"{max(0, exc.estimated_completion - int(now.timestamp()))} s from now; close the "
            "job and send them to a job with a longer completion_window",
            earliest_window=exc.earliest_window,
            estimated_completion=exc.estimated_completion,
        ) from None


def close_documents(repo: SummaryStore, tenant: TenantRecord, job_id: str) -> SummaryJobRecord:
    """The job takes no more documents: it completes once those it has are summarised.
    Closing a job again, or one that ended, changes nothing; a job still receiving is
    started instead (:func:`start_job`)."""
    job = repo.summary_jobs.get_summary_job(tenant.id, job_id)
    if job.state is SummaryJobState.RECEIVING:
        raise StaleWrite(
            f"summary job {job.id} is receiving: start it (its documents close with a start "
            "without more_documents)"
        )
    repo.summary_jobs.close_documents(job.id)
    return repo.summary_jobs.get_summary_job(tenant.id, job.id)


def start_job(
    repo: SummaryStore,
    settings: Settings,
    tenant: TenantRecord,
    job: SummaryJobRecord,
    *,
    now: datetime | None = None,
    more_documents: bool = False,
    expected_documents: int | None = None,
) -> SummaryJobRecord:
    """Admit the job on its whole forecast (map steps and every reduce step at its bound)
    and start it under one deadline; :class:`DeadlineInfeasible` leaves it receiving, as
    does :class:`LimitReached`: a started job counts as one of the tenant's active batches
    (the batches it makes do not count: they are its, not the tenant's).

    With ``more_documents`` it starts before its last document: its map steps run while
    the rest are sent (each page judged against its deadline as it comes), and it completes
    only once closed. ``expected_documents`` (how many the client will send in all, where
    it knows) has the start judge the whole job, its forecast scaled from those received,
    so a job that cannot finish in its window is refused before it runs, not mid-way."""
    if job.state is not SummaryJobState.RECEIVING:
        return job
    if expected_documents is not None and not more_documents:
        raise InvalidRequest(
            "expected_documents goes with more_documents", param="expected_documents"
        )
    window_s = checked_window(
        job.completion_window, settings.min_completion_window_s, settings.max_completion_window_s
    )
    check_active_limit(repo, settings, tenant.id)
    now = now or repo.now()
    forecast = job.forecast_tokens
    if expected_documents is not None:
        received = sum(repo.summary_reports.summary_counts(job.id).documents.values())
        forecast = scaled_forecast(forecast, received, expected_documents)
    admission = Admission(
        forecast=forecast,
        now=now,
        window_s=window_s,
        throughput_tps=batch_throughput(settings.batch_throughput_tokens_per_s),
        completion_window=job.completion_window,
    )
    judge_tokens(repo, settings, tenant, forecast, admission)
    with contextlib.suppress(StaleWrite):
        repo.summary_jobs.move_summary_job(
            job.id,
            SummaryJobState.IN_PROGRESS,
            deadline=now + timedelta(seconds=window_s),
            documents_open=more_documents,
        )
    return repo.summary_jobs.get_summary_job(tenant.id, job.id)


def scaled_forecast(forecast: int, received: int, expected: int) -> int:
    """The forecast of ``expected`` documents from that of the ``received`` ones (never
    less than what was received)."""
    if received <= 0 or expected <= received:
        return forecast
    return -(-forecast * expected // received)


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
