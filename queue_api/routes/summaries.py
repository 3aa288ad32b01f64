"""``/v1/summary_jobs``: summarisation jobs, a dataset of documents in and one summary per
document out (``backfill.summarize``). Create a job, send its documents (JSON lines, in as
many requests as needed), start it, watch it, cancel it, read its results as they come.

The engine's own numbers shape the job: its context length, and what its chat template makes
of the instructions; documents are split with its tokenizer (``/tokenize``), so a chunk fits
as the engine counts it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from backfill.engine.local_tokenizer import CheckedCount, LocalCounts
from backfill.engine.protocol import Engine, EngineError
from backfill.errors import BackfillError, StaleWrite
from backfill.gateway.refusals import GatewayUnavailable
from backfill.refusals import InvalidRequest, ModelNotFound
from backfill.store import Repository
from backfill.store.records import TenantRecord
from backfill.store.summaries import NewDocument, SummaryJobRecord
from backfill.summarize import driver, jobs
from backfill.summarize.job_plan import JobShape
from backfill.summarize.prompts import map_messages, reduce_messages
from backfill.summarize.states import SummaryJobState
from backfill.summarize.writer import SummaryRow
from queue_api.deps import RepositoryDep, SettingsDep, TenantDep
from queue_api.summary_schemas import (
    CreateSummaryJobBody,
    DocumentsAdded,
    StartSummaryJobBody,
    SummaryJobList,
    SummaryJobObject,
)

router = APIRouter(prefix="/v1/summary_jobs", tags=["summaries"])
log = logging.getLogger("backfill.summarize")


def _render(repo: Repository, job: SummaryJobRecord) -> SummaryJobObject:
    counts = repo.summary_reports.summary_counts(job.id)
    progress = jobs.progress(job, counts, repo.now())
    return SummaryJobObject.of(job, progress, repo.summary_batches.summary_batch_ids(job.id))


async def _serving_engine(request: Request, model: str) -> tuple[Engine, int]:
    """An engine serving ``model`` and its context length."""
    engine, context, _ = await _serving_node(request, model)
    return engine, context


async def _serving_node(request: Request, model: str) -> tuple[Engine, int, str]:
    """An engine serving ``model``, its context length and its URL."""
    gateway = request.app.state.gateway
    serving, any_node = await gateway.admission.directory.serving(model)
    nodes = [n for n in serving if n.max_model_len]
    if not nodes:
        why = next((n.unanswered for n in serving if n.unanswered), None)
        if why is not None:
            # Registered for the model, but its engine did not answer (a refused key, down):
            # the operator's problem to name, not the caller's model.
            raise GatewayUnavailable(
                f"no engine serving `{model}` told its context length: {why}", retry_after_s=5.0
            )
        if any_node:
            raise ModelNotFound(f"The model `{model}` is not served by any node", param="model")
        raise GatewayUnavailable("no engine is registered yet", retry_after_s=5.0)
    url = nodes[0].engine_url
    return gateway.engine(url), int(nodes[0].max_model_len), url


async def _local_count(
    request: Request, engine: Engine, url: str, model: str
) -> CheckedCount | None:
    """The engine's tokenizer read from its model's files, where this process can read them
    (checked against the engine's own counts: ``backfill.engine.local_tokenizer``); None
    where it cannot, or where the deployment turned it off."""
    settings = request.app.state.settings
    if not settings.local_token_counts:
        return None
    counts: LocalCounts = request.app.state.local_counts
    return await counts.counter(engine, url, model)


@router.post("")
async def create_summary_job(
    body: CreateSummaryJobBody,
    request: Request,
    tenant: TenantDep,
    repo: RepositoryDep,
    settings: SettingsDep,
) -> SummaryJobObject:
    engine, model_context = await _serving_engine(request, body.model)
    # A step is refused at run time past the batch class's limit, as past the model's.
    context = min(model_context, settings.batch_max_sequence_tokens)
    try:
        map_tokens = await engine.tokenize_chat(map_messages(body.instruction, ""), body.model)
        reduce_tokens = await engine.tokenize_chat(
            reduce_messages(body.instruction, []), body.model
        )
    except EngineError as exc:
        raise GatewayUnavailable(f"the engine did not count: {exc}", retry_after_s=5.0) from exc
    shape = JobShape(context, map_tokens, reduce_tokens, body.max_summary_tokens)
    request_ = jobs.SummaryJobRequest(
        body.model,
        body.instruction,
        body.max_summary_tokens,
        body.completion_window,
        body.sampling,
    )
    job = await run_in_threadpool(jobs.create_job, repo, settings, tenant, request_, shape)
    return await run_in_threadpool(_render, repo, job)


_Row = tuple[str | None, str | None, str | None]
"""A document line's ``(id, text, error)``."""


def _document_rows(raw: bytes) -> list[_Row]:
    """``(id, text, error)`` of each JSON line of a documents body."""
    rows = []
    for number, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record: Any = json.loads(line)
        except ValueError:
            raise InvalidRequest(f"line {number} is not JSON", param="documents") from None
        if not isinstance(record, dict):
            raise InvalidRequest(f"line {number} is not a JSON object", param="documents")
        doc_id, text, error = record.get("id"), record.get("text"), record.get("error")
        for name, value in (("id", doc_id), ("text", text), ("error", error)):
            if value is not None and not isinstance(value, str):
                raise InvalidRequest(f"line {number}: {name} must be a string", param=name)
        rows.append((doc_id, text, error))
    return rows


COUNTS_IN_FLIGHT = 8
"""Documents prepared at once in an API process, whatever the requests: preparing one is
mostly waiting on the engine's ``/tokenize`` (a round trip per count), and one at a time a
job of 200 documents waited ~4 s for its first batch on a 2-core machine. Their threads are
bounded by a limiter of their own (``app.state.document_counts``), not the shared pool's
tokens, so no other request waits for a thread while documents are counted."""


async def _in_order(
    rows: Sequence[_Row],
    prepare: Callable[[_Row], NewDocument],
    slots: anyio.CapacityLimiter,
) -> list[NewDocument]:
    """``prepare`` of every row, a slice at a time on threads as ``slots`` admit them, in the
    rows' order. The first failure is raised as it is (not in a group), the rest left undone."""
    done: list[NewDocument | None] = [None] * len(rows)
    # A few slices a worker, not a thread hop a row: most documents fit by their bytes and
    # ask the engine nothing, and a hop costs more than preparing one of them.
    size = max(1, len(rows) // (COUNTS_IN_FLIGHT * 4))
    order = iter(range(0, len(rows), size))

    def prepare_slice(start: int) -> None:
        for i in range(start, min(start + size, len(rows))):
            done[i] = prepare(rows[i])

    async def worker() -> None:
        for start in order:  # one iterator shared by the workers: each slice taken once
            await anyio.to_thread.run_sync(prepare_slice, start, limiter=slots)

    try:
        async with anyio.create_task_group() as group:
            for _ in range(min(COUNTS_IN_FLIGHT, len(rows))):
                group.start_soon(worker)
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    return [d for d in done if d is not None]


@router.post("/{job_id}/documents")
async def add_documents(
    job_id: str, request: Request, tenant: TenantDep, repo: RepositoryDep, settings: SettingsDep
) -> DocumentsAdded:
    """Documents as JSON lines: ``{"id": ..., "text": ...}``, or ``{"id": ..., "error": ...}``
    for a row the client could not read (it is kept, with its error, in the results). A job
    started with ``more_documents`` takes them while it runs: they are judged against its
    deadline, and its next round cuts them into a batch at once."""
    job = await run_in_threadpool(repo.summary_jobs.get_summary_job, tenant.id, job_id)
    if not jobs.takes_documents(job):  # refused before a document is counted
        raise StaleWrite(
            f"summary job {job.id} is {job.state.value}: it takes documents only while "
            "receiving, or started with more_documents and not closed"
        )
    engine, _, url = await _serving_node(request, job.model)
    rows = _document_rows(await request.body())
    local = await _local_count(request, engine, url, job.model)

    def engine_count(text: str) -> int:
        return int(anyio.from_thread.run(engine.tokenize_prompt, text, job.model))

    def count(text: str) -> int:
        return engine_count(text) if local is None else local.count(text, engine_count)

    def prepare(row: tuple[str | None, str | None, str | None]) -> NewDocument:
        doc_id, text, error = row
        if error is not None:
            return NewDocument(doc_id, error=error)
        return jobs.prepare_document(job, doc_id, text, count)

    def store(documents: list[NewDocument]) -> DocumentsAdded:
        first = jobs.add_documents(repo, settings, tenant, job, documents)
        if job.state is SummaryJobState.IN_PROGRESS:
            _batch_now(repo, settings, job.id)
        return DocumentsAdded(
            first=first,
            received=len(documents),
            failed=sum(d.error is not None for d in documents),
            split=sum(len(d.bodies) > 1 for d in documents),
        )

    async def prepare_and_store() -> DocumentsAdded:
        documents = await _in_order(rows, prepare, request.app.state.document_counts)
        return await anyio.to_thread.run_sync(store, documents)

    try:
        return await prepare_and_store()
    except EngineError as exc:
        raise GatewayUnavailable(f"the engine did not count: {exc}", retry_after_s=5.0) from exc


def _round_now(repo: Repository, settings: Any, job_id: str) -> None:
    """The job's round now, not at the next maintenance tick: a batch of its map steps
    (bounded: the request answers quickly); the rest at the next round."""
    try:
        driver.drive_now(repo, settings, job_id, driver.START_ROUND_STEPS)
    except BackfillError as exc:
        log.warning("summary job %s: its round left to the tick: %s", job_id, exc)


def _batch_now(repo: Repository, settings: Any, job_id: str) -> None:
    """A running job's new documents cut into a batch now (bounded), not a whole round."""
    try:
        driver.batch_now(repo, settings, job_id)
    except BackfillError as exc:
        log.warning("summary job %s: its new documents' batch left to a round: %s", job_id, exc)


def _start(
    repo: Repository,
    settings: Any,
    tenant: TenantRecord,
    job_id: str,
    body: StartSummaryJobBody,
) -> SummaryJobObject:
    job = jobs.start_job(
        repo,
        settings,
        tenant,
        repo.summary_jobs.get_summary_job(tenant.id, job_id),
        more_documents=body.more_documents,
        expected_documents=body.expected_documents,
    )
    if job.state is SummaryJobState.IN_PROGRESS:
        _round_now(repo, settings, job.id)
    return _render(repo, repo.summary_jobs.get_summary_job(tenant.id, job.id))


@router.post("/{job_id}/start")
def start_summary_job(
    job_id: str,
    tenant: TenantDep,
    repo: RepositoryDep,
    settings: SettingsDep,
    body: StartSummaryJobBody | None = None,
) -> SummaryJobObject:
    """Admit the job on its whole forecast (refused when its window cannot be met) and run
    it under one deadline; a first batch of its map steps is made before the answer. With
    ``more_documents`` it starts before its last document (see ``StartSummaryJobBody``)."""
    return _start(repo, settings, tenant, job_id, body or StartSummaryJobBody())


@router.post("/{job_id}/close")
def close_summary_job(
    job_id: str, tenant: TenantDep, repo: RepositoryDep, settings: SettingsDep
) -> SummaryJobObject:
    """No more documents for a job started with ``more_documents``: it completes once those
    it has are summarised. Closing again, or a job that ended, changes nothing."""
    job = jobs.close_documents(repo, tenant, job_id)
    if job.state is SummaryJobState.IN_PROGRESS:
        _round_now(repo, settings, job.id)  # all of it may be summarised already
    return _render(repo, repo.summary_jobs.get_summary_job(tenant.id, job.id))


@router.get("")
def list_summary_jobs(
    tenant: TenantDep, repo: RepositoryDep, limit: Annotated[int, Query(ge=1, le=100)] = 20
) -> SummaryJobList:
    """The tenant's jobs, newest first (the dashboard's view)."""
    records = repo.summary_jobs.list_summary_jobs(tenant.id, limit + 1)
    return SummaryJobList(
        data=[_render(repo, job) for job in records[:limit]], has_more=len(records) > limit
    )


@router.get("/{job_id}")
def retrieve_summary_job(job_id: str, tenant: TenantDep, repo: RepositoryDep) -> SummaryJobObject:
    return _render(repo, repo.summary_jobs.get_summary_job(tenant.id, job_id))


@router.post("/{job_id}/cancel")
def cancel_summary_job(job_id: str, tenant: TenantDep, repo: RepositoryDep) -> SummaryJobObject:
    return _render(repo, jobs.cancel_job(repo, tenant, job_id))


def _lines(rows: Any) -> Any:
    row: SummaryRow
    for row in rows:
        yield json.dumps(asdict(row), ensure_ascii=False) + "\n"


@router.get("/{job_id}/results", response_model=None)
def summary_results(job_id: str, tenant: TenantDep, repo: RepositoryDep) -> StreamingResponse:
    """One JSON line per document, in source order: its id, summary, error, usage, chunks and
    split depth; documents still running have no summary yet."""
    job = repo.summary_jobs.get_summary_job(tenant.id, job_id)
    return StreamingResponse(_lines(jobs.result_rows(repo, job.id)), media_type="application/jsonl")
