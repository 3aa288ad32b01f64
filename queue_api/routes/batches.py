"""``/v1/batches``: OpenAI's Batch API, plus results streamed while a batch runs."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query
from fastapi.responses import StreamingResponse

from backfill import batches, finalize
from backfill.config import Settings
from backfill.progress import job_progress
from backfill.results import iter_result_lines, parse_result_states
from backfill.states import JobState
from backfill.store import JobRecord, Repository
from backfill.store.prefixes import PrefixGroupRecord
from backfill.windows import batch_throughput
from queue_api.deps import IngestersDep, IngestSlotsDep, RepositoryDep, SettingsDep, TenantDep
from queue_api.schemas import BatchList, BatchObject, CreateBatchBody

router = APIRouter(prefix="/v1/batches", tags=["batches"])


def _render(
    job: JobRecord,
    settings: Settings,
    repo: Repository,
    groups: list[PrefixGroupRecord] | None = None,
) -> BatchObject:
    """The Batch object of ``job``; ``groups``: its prefix groups when already read (a list
    reads a page's at once)."""
    tps = batch_throughput(settings.batch_throughput_tokens_per_s)
    if groups is None:
        # A job still validating has no items, so no prefix groups: no query for it (every
        # large create answers one).
        groups = [] if job.state is JobState.VALIDATING else repo.prefixes.prefix_groups(job.id)
    # Progress judges Postgres' timestamps: on its clock (this host's may be off).
    return BatchObject.of(job, job_progress(job, repo.now(), tps), groups)


@router.post("")
def create_batch(
    body: CreateBatchBody,
    tenant: TenantDep,
    repo: RepositoryDep,
    settings: SettingsDep,
    slots: IngestSlotsDep,
    ingesters: IngestersDep,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=256)] = None,
) -> BatchObject:
    request = batches.BatchRequest(
        input_file_id=body.input_file_id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        metadata=body.metadata,  # the core checks the shape
        output_expires_after=body.output_expires_after,
        idempotency_key=idempotency_key or None,
    )
    with slots.held(tenant.id):
        job = batches.create_batch(repo, settings, tenant, request)
    if job.state is JobState.VALIDATING:
        ingesters.wake()  # a large file: an ingest process checks and stores it
    return _render(job, settings, repo)


@router.get("")
def list_batches(
    tenant: TenantDep,
    repo: RepositoryDep,
    settings: SettingsDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> BatchList:
    jobs = repo.jobs.list_jobs(tenant.id, after=after, limit=limit + 1)
    # The page's prefix groups in one query, not one a job.
    shown = [j for j in jobs[:limit] if j.state is not JobState.VALIDATING]
    groups = repo.prefixes.prefix_groups_of([j.id for j in shown])
    data = [_render(j, settings, repo, groups.get(j.id, [])) for j in jobs[:limit]]
    return BatchList.page(data, len(jobs) > limit)


@router.get("/{batch_id}")
def retrieve_batch(
    batch_id: str, tenant: TenantDep, repo: RepositoryDep, settings: SettingsDep
) -> BatchObject:
    return _render(repo.jobs.get_job(tenant.id, batch_id), settings, repo)


@router.post("/{batch_id}/cancel")
def cancel_batch(
    batch_id: str, tenant: TenantDep, repo: RepositoryDep, settings: SettingsDep
) -> BatchObject:
    return _render(finalize.cancel_job(repo, tenant.id, batch_id), settings, repo)


@router.get("/{batch_id}/results", response_model=None)
def stream_results(
    batch_id: str,
    tenant: TenantDep,
    repo: RepositoryDep,
    state: Annotated[
        list[str] | None,
        Query(
            description="Finished states to include: succeeded, failed, expired, cancelled "
            "(repeat or separate by commas); default: all of them."
        ),
    ] = None,
) -> StreamingResponse:
    """Finished results so far, as OpenAI output/error lines, in input line order."""
    wanted = parse_result_states(state)
    job = repo.jobs.get_job(tenant.id, batch_id)
    return StreamingResponse(
        iter_result_lines(repo, job.id, wanted), media_type="application/jsonl"
    )
