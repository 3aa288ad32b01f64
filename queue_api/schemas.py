"""Wire shapes: OpenAI's File and Batch objects, plus Backfill's extras.

Backfill's additions live under one extra key (``backfill``) so the openai SDK, which keeps
unknown fields, parses every object unchanged. Times are unix seconds, as OpenAI's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field

from backfill.capacity_view import CapacityReport
from backfill.progress import Progress
from backfill.states import ItemState
from backfill.store import FilePage, FileRecord, JobRecord
from backfill.store.prefixes import PrefixGroupRecord


def unix(at: datetime | None) -> int | None:
    return None if at is None else int(at.timestamp())


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None

    @classmethod
    def of(cls, record: FileRecord) -> FileObject:
        return cls(
            id=record.id,
            bytes=record.size_bytes,
            created_at=int(record.created_at.timestamp()),
            filename=record.filename,
            purpose=record.purpose,
            expires_at=unix(record.expires_at),
        )


class HasId(Protocol):
    @property
    def id(self) -> str: ...


class CursorList(BaseModel):
    """OpenAI's list object: a page of ``data`` (each subclass names its items), the first
    and last ids on it (the next page is ``after=last_id``), and whether more follow."""

    object: Literal["list"] = "list"
    data: Sequence[Any]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def page(cls, data: Sequence[HasId], has_more: bool) -> Self:
        return cls(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=has_more,
        )


class FileList(CursorList):
    data: list[FileObject]


def file_list_json(records: Sequence[FileRecord], has_more: bool) -> bytes:
    """A :class:`FileList` of ``records`` as JSON, written directly: the same object, field
    for field, but a page of 10,000 files built as models cost ~70 us a file (0.4-0.9 s a
    page on a busy API, holding its interpreter), written here a few. (The API sends
    :func:`file_page_json`, the same bytes written by Postgres.)"""
    dumps = json.dumps
    data = ",".join(
        f'{{"id":{dumps(r.id)},"object":"file","bytes":{r.size_bytes},'
        f'"created_at":{int(r.created_at.timestamp())},'
        f'"filename":{dumps(r.filename, ensure_ascii=False)},"purpose":{dumps(r.purpose)},'
        f'"status":"processed","status_details":null,'
        f'"expires_at":{"null" if r.expires_at is None else int(r.expires_at.timestamp())}}}'
        for r in records
    )
    first = records[0].id if records else None
    last = records[-1].id if records else None
    return _list_json(data, first, last, has_more)


def file_page_json(page: FilePage) -> bytes:
    """A :class:`FileList` of a page whose objects Postgres wrote (``list_files_page``)."""
    return _list_json(page.data, page.first_id, page.last_id, page.has_more)


def _list_json(data: str, first_id: str | None, last_id: str | None, has_more: bool) -> bytes:
    first = json.dumps(first_id) if first_id is not None else "null"
    last = json.dumps(last_id) if last_id is not None else "null"
    more = "true" if has_more else "false"
    return (
        f'{{"object":"list","data":[{data}],"first_id":{first},"last_id":{last},"has_more":{more}}}'
    ).encode()


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


class CreateBatchBody(BaseModel):
    """OpenAI's create parameters. Values are checked by the core (one set of messages)."""

    model_config = ConfigDict(extra="ignore")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, Any] | None = None
    output_expires_after: Any = None


class BatchErrorEntry(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorEntry] = Field(default_factory=list)


class RequestCounts(BaseModel):
    total: int
    completed: int
    """Requests that succeeded (in the output file)."""
    failed: int
    """Requests that failed, expired or were cancelled (in the error file)."""


class TokenProgress(BaseModel):
    done: int = Field(description="Output tokens generated so far.")
    total: int = Field(description="Output tokens declared (sum of max_tokens): the worst case.")
    prompt: int = Field(description="Prompt tokens counted so far by the engine's tokenizer.")


class PrefixGroupObject(BaseModel):
    """Items of the batch that start with one shared prompt prefix, held once per node by
    the engine's prefix cache."""

    id: str = Field(description="The prefix's id (its tokens, model and tenant).")
    blocks: int = Field(description="Its length in whole KV blocks.")
    items: int = Field(description="Items of this batch that start with it.")


class BackfillExtras(BaseModel):
    """Beyond OpenAI: progress by item state, tokens, ETA, the deadline, shared prefixes."""

    model: str | None
    deadline: int
    items: dict[str, int] = Field(description="Items per state.")
    tokens: TokenProgress
    eta: int | None = Field(description="Estimated completion (unix seconds), while running.")
    eta_basis: Literal["observed", "forecast"] | None = None
    at_risk: bool = Field(description="The ETA is past the deadline.")
    prefixes: list[PrefixGroupObject] = Field(
        default_factory=list,
        description="Shared prompt prefixes found among its items (none until found).",
    )


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """OpenAI's Batch ``usage``: tokens of the requests that succeeded so far."""

    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: str
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts
    usage: BatchUsage
    metadata: dict[str, Any] | None = None
    backfill: BackfillExtras

    @classmethod
    def of(
        cls,
        job: JobRecord,
        progress: Progress,
        prefixes: Sequence[PrefixGroupRecord] = (),
    ) -> BatchObject:
        counts = job.counts
        stamps = {name: unix(at) for name, at in job.timestamps.items()}
        not_succeeded = sum(
            counts.count(s) for s in (ItemState.FAILED, ItemState.EXPIRED, ItemState.CANCELLED)
        )
        return cls(
            id=job.id,
            endpoint=job.endpoint,
            model=job.model,
            errors=BatchErrors(data=[BatchErrorEntry(**e) for e in job.errors])
            if job.errors
            else None,
            input_file_id=job.input_file_id,
            completion_window=job.completion_window,
            status=job.state.value,
            output_file_id=job.output_file_id,
            error_file_id=job.error_file_id,
            created_at=int(job.created_at.timestamp()),
            expires_at=unix(job.deadline),
            request_counts=RequestCounts(
                total=counts.total,
                completed=counts.count(ItemState.SUCCEEDED),
                failed=not_succeeded,
            ),
            usage=BatchUsage(
                input_tokens=counts.input_tokens,
                output_tokens=counts.output_tokens,
                total_tokens=counts.input_tokens + counts.output_tokens,
            ),
            metadata=job.metadata,
            backfill=BackfillExtras(
                model=job.model,
                deadline=int(job.deadline.timestamp()),
                items=progress.items,
                tokens=TokenProgress(
                    done=progress.output_tokens_done,
                    total=progress.output_tokens_max,
                    prompt=progress.prompt_tokens,
                ),
                eta=unix(progress.eta),
                eta_basis=progress.eta_basis,
                at_risk=progress.at_risk,
                prefixes=[
                    PrefixGroupObject(id=p.prefix_id, blocks=p.blocks, items=p.items)
                    for p in prefixes
                ],
            ),
            **stamps,
        )


class BatchList(CursorList):
    data: list[BatchObject]


# ---------------------------------------------------------------------------------------------
# Capacity
# ---------------------------------------------------------------------------------------------


class WorkBudgetObject(BaseModel):
    max_seqs: int = Field(description="Batch sequences in flight at most.")
    max_prefill_tokens: int = Field(description="Batch prompt tokens in prefill at most.")
    hold: bool = Field(description="New batch prefills are held (interactive waits/prefills).")
    reason_code: str = Field(description="Why the budget last changed (a BudgetReason).")
    reason: str
    changed_at: float = Field(description="When it last changed (Unix seconds).")
    batch_in_flight: int
    batch_prefill_tokens: int
    updated_at: float = Field(description="When a worker last published it (Unix seconds).")
    workers: int = Field(
        default=1, description="Worker processes whose budgets this sums (each runs its own)."
    )


class EngineSchedulerObject(BaseModel):
    name: str = Field(description="The step scheduler the engine runs, and its vLLM.")
    batch_priority: int = Field(description="Requests at this priority or above are batch.")
    paused_steps: int = Field(description="Steps in which resident batch carried no tokens.")
    tokens_held: int = Field(description="Tokens paused batch would have carried then.")
    pauses: int
    relief: int = Field(description="Paused batch given tokens at the starvation bound.")
    preemptions: int = Field(description="Batch preempted in the engine for interactive work.")
    paused_now: int
    longest_pause_s: float


class NodeCapacityObject(BaseModel):
    name: str
    model: str | None
    capacity_tokens: int = Field(description="Measured pool: num_gpu_blocks x block_size.")
    num_blocks: int
    block_size: int
    interactive_reserve_tokens: int
    batch_reserved_tokens: int = Field(description="Batch reservations recorded in Postgres.")
    interactive_in_use: int | None = Field(description="From the ledger; null without it.")
    batch_in_use: int | None = Field(description="From the ledger; null without it.")
    slack_tokens: int
    source: Literal["ledger", "postgres"]
    last_seen_at: int
    work_budget: WorkBudgetObject | None = Field(
        default=None, description="The node's batch work budget; null when no worker runs one."
    )
    engine_scheduler: EngineSchedulerObject | None = Field(
        default=None,
        description="Backfill's step scheduler in the node's engine (it pauses batch in the "
        "steps interactive work needs); null: the engine runs vLLM's own scheduler.",
    )


class ModelPoolObject(BaseModel):
    nodes: list[str] = Field(description="The nodes whose engine serves the model.")
    capacity_tokens: int
    slack_tokens: int = Field(description="Batch slack over those nodes.")
    batch_in_use: int
    interactive_in_use: int
    endpoints: list[str] | None = Field(
        default=None,
        description="The batch endpoints those nodes' engines serve (null: a node did not say).",
    )


class CapacityObject(BaseModel):
    object: Literal["capacity"] = "capacity"
    nodes: list[NodeCapacityObject]
    models: dict[str, ModelPoolObject] = Field(
        description="Pools per served model: a batch runs only on nodes serving its model."
    )
    queued_tokens: dict[str, int]

    @classmethod
    def of(cls, report: CapacityReport) -> CapacityObject:
        return cls(
            nodes=[
                NodeCapacityObject(
                    name=n.name,
                    model=n.model,
                    capacity_tokens=n.capacity_tokens,
                    num_blocks=n.num_blocks,
                    block_size=n.block_size,
                    interactive_reserve_tokens=n.interactive_reserve_tokens,
                    batch_reserved_tokens=n.batch_reserved_tokens,
                    interactive_in_use=n.interactive_in_use,
                    batch_in_use=n.batch_in_use,
                    slack_tokens=n.slack_tokens,
                    source=n.source,
                    last_seen_at=int(n.last_seen_at.timestamp()),
                    work_budget=None
                    if n.work_budget is None
                    else WorkBudgetObject(
                        max_seqs=n.work_budget.max_seqs,
                        max_prefill_tokens=n.work_budget.max_prefill_tokens,
                        hold=n.work_budget.hold,
                        reason_code=n.work_budget.code,
                        reason=n.work_budget.reason,
                        changed_at=n.work_budget.changed_at_s,
                        batch_in_flight=n.work_budget.in_flight,
                        batch_prefill_tokens=n.work_budget.prefill_tokens,
                        updated_at=n.work_budget.at_s,
                        workers=n.work_budget.workers,
                    ),
                    engine_scheduler=None
                    if n.engine_scheduler is None
                    else EngineSchedulerObject(
                        name=n.engine_scheduler.name,
                        batch_priority=n.engine_scheduler.batch_priority,
                        paused_steps=n.engine_scheduler.paused_steps,
                        tokens_held=n.engine_scheduler.tokens_held,
                        pauses=n.engine_scheduler.pauses,
                        relief=n.engine_scheduler.relief,
                        preemptions=n.engine_scheduler.preemptions,
                        paused_now=n.engine_scheduler.paused_now,
                        longest_pause_s=n.engine_scheduler.longest_pause_s,
                    ),
                )
                for n in report.nodes
            ],
            models={
                model: ModelPoolObject(
                    nodes=list(pool.nodes),
                    capacity_tokens=pool.capacity_tokens,
                    slack_tokens=pool.slack_tokens,
                    batch_in_use=pool.batch_in_use,
                    interactive_in_use=pool.interactive_in_use,
                    endpoints=None if pool.endpoints is None else list(pool.endpoints),
                )
                for model, pool in report.models.items()
            },
            queued_tokens=report.queued_tokens,
        )
