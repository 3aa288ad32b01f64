"""What each part of Backfill asks of the store: one protocol per role, no more than it calls.

:class:`~backfill.store.Repository` is the one implementation. Consumers take a role instead,
so what each part reads and writes in Postgres is written down here, and mypy proves the
repository has it where the concrete one is handed over (``worker.node``, ``worker.tasks``,
``backfill.gateway.admission``, the API's routes).

- :class:`AttemptStore`: a worker node's dispatcher, claiming items and writing what becomes
  of each attempt (``worker.dispatch*``).
- :class:`NodeRecords`: the gateway's node directory, reading the registered nodes.
- :class:`ItemPages`: the result renderer, reading a job's items page by page
  (``backfill.results``).
- :class:`JobMoves`: reading a job and moving it, on Postgres' clock; shared by the next two.
- :class:`BatchStore`: the API's batch and file side, storing uploads and creating batches
  (``backfill.batches``).
- :class:`JobLifecycle`: finalizing, cancelling, expiring and recovering jobs
  (``backfill.finalize``).
- :class:`QueueStats`: the scrape-time metrics, reading totals and token figures
  (``backfill.telemetry``).
- :class:`CapacityRecords`: the capacity view, reading nodes, live attempts and the backlog
  (``backfill.capacity_view``).
- :class:`MaintenanceStore`: the maintenance tick, which also rebuilds the ledger from the
  records of live attempts and reaps lost ones (``backfill.maintenance``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, BinaryIO, Protocol

from backfill.fairshare import TenantBacklog
from backfill.states import ItemState, JobState
from backfill.store import records as sr
from backfill.store.ingest_queue import IngestTake
from backfill.store.open_claims import OpenClaim
from backfill.store.retention import PurgeReport
from backfill.store.summaries import (
    DocumentRow,
    FinishedStep,
    NewDocument,
    NewStep,
    StepBacklog,
    SummaryCounts,
    SummaryJobRecord,
)
from backfill.summarize.decide import StepView
from backfill.summarize.job_plan import JobShape
from backfill.summarize.states import SummaryJobState


class AttemptStore(Protocol):
    """Claims and attempts, as a node's dispatcher writes them: an open claim and its start
    (or drop), heartbeat, and the end of each attempt, every write fenced by its attempt (and
    lease)."""

    def open_claim(
        self,
        node: str,
        limit: int,
        lease_ttl_s: float,
        *,
        models: Sequence[str] | None = ...,
        prefix_hold_s: float | None = ...,
    ) -> OpenClaim: ...

    def start_claim(
        self, claim: OpenClaim, starts: Sequence[sr.Start], held: Sequence[tuple[int, int]] = ...
    ) -> list[int]: ...

    def drop_claim(self, claim: OpenClaim) -> None: ...

    def expire_claimed(self, item_id: int, attempt: int, reason: str) -> None: ...

    def heartbeat(self, held: Sequence[tuple[int, int]], lease_ttl_s: float) -> list[int]: ...

    def finish(self, finishes: Sequence[sr.Finish]) -> list[int]: ...

    def fail(
        self, item_id: int, attempt: int, error: str, *, fencing_token: int | None = ...
    ) -> None: ...

    def give_back(
        self,
        item_id: int,
        attempt: int,
        target: ItemState,
        *,
        retry_after_s: float | None = ...,
        detail: str | None = ...,
    ) -> None: ...

    def preempt(
        self,
        item_id: int,
        attempt: int,
        fencing_token: int,
        *,
        partial_output: str | None,
        partial_tokens: int,
    ) -> None: ...

    def requeue(
        self,
        item_id: int,
        attempt: int,
        fencing_token: int,
        *,
        partial_output: str | None,
        partial_tokens: int,
        detail: str,
        retry_after_s: float | None = ...,
    ) -> None: ...


class NodeRecords(Protocol):
    """The registered nodes (engines, pools, models served)."""

    def nodes(self) -> list[sr.NodeRecord]: ...


class QueueStats(NodeRecords, Protocol):
    """What the metrics read: items and jobs per state, the batch backlog, and the token
    figures of the items that finished."""

    def item_state_totals(self) -> dict[ItemState, int]: ...

    def job_state_totals(self) -> dict[JobState, int]: ...

    def backlog_tokens(self) -> int: ...

    def output_tokens_finished_within(self, seconds: float) -> int: ...

    def ingest_backlog(self) -> tuple[int, float]: ...

    def finished_token_stats(
        self, since: datetime | None, bounds: Sequence[int], *, lookback_s: float, lag_s: float
    ) -> sr.FinishedTokenStats: ...


class CapacityRecords(NodeRecords, Protocol):
    """What the capacity view reads: the nodes, the attempts holding leases, the backlog."""

    def active_leases(self) -> list[sr.ActiveLeaseRow]: ...

    def backlog_tokens(self) -> int: ...


class ItemPages(Protocol):
    """A job's items in line order, a page at a time."""

    def items(
        self,
        job_id: str,
        *,
        states: Iterable[ItemState] | None = ...,
        after_line: int = ...,
        limit: int = ...,
    ) -> list[sr.ItemRecord]: ...


class JobMoves(Protocol):
    """A job read and moved (guarded by its state), and Postgres' clock."""

    def get_job(self, tenant_id: str | None, job_id: str) -> sr.JobRecord: ...

    def move_job(
        self,
        job_id: str,
        target: JobState,
        *,
        reason: str | None = ...,
        errors: list[dict[str, Any]] | None = ...,
        output_file_id: str | None = ...,
        error_file_id: str | None = ...,
    ) -> JobState: ...

    def now(self) -> datetime: ...


class BatchStore(JobMoves, ItemPages, Protocol):
    """The API's batch side: uploads and their pieces, a batch created and its items stored,
    and what admission weighs (a tenant's jobs and queued tokens, the backlog, the models
    served)."""

    def create_file(
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        content: bytes | BinaryIO | Iterable[bytes],
        *,
        chunk_bytes: int = ...,
        expires_after_s: int | None = ...,
        tokens_bound: Callable[[], int | None] | None = ...,
    ) -> sr.FileRecord: ...

    def get_file(self, tenant_id: str, file_id: str) -> sr.FileRecord: ...

    def file_pieces(self, tenant_id: str, file_id: str) -> Iterator[bytes] | None: ...

    def file_head(self, tenant_id: str, file_id: str, max_bytes: int) -> bytes: ...

    def file_chunks(self, tenant_id: str, file_id: str) -> Iterator[bytes] | None: ...

    def create_job(
        self,
        tenant_id: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        deadline: datetime,
        *,
        metadata: dict[str, Any] | None = ...,
        idempotency_key: str | None = ...,
        model: str | None = ...,
        output_expires_after_s: int | None = ...,
        ingest_deferred: bool = ...,
    ) -> sr.JobRecord: ...

    def job_id_for_idempotency_key(self, tenant_id: str, idempotency_key: str) -> str | None: ...

    def insert_items(
        self,
        job_id: str,
        items: Iterable[sr.NewItem],
        *,
        start_reason: Callable[[int], str] | None = ...,
    ) -> int: ...

    def count_active_jobs(self, tenant_id: str) -> int: ...

    def deferred_creates(self, tenant_id: str) -> int: ...

    def tenant_by_id(self, tenant_id: str) -> sr.TenantRecord: ...

    def stored_items(self, tenant_id: str) -> int: ...

    def stored_input_bytes(self, tenant_id: str) -> int: ...

    def enqueued_tokens(self, tenant_id: str) -> int: ...

    def backlog_tokens(self) -> int: ...

    def backlog_by_tenant(self) -> list[TenantBacklog]: ...

    def served_models(self, live_within_s: float) -> tuple[set[str], bool]: ...

    def served_endpoints(self, model: str, live_within_s: float) -> set[str] | None: ...


class IngestStore(BatchStore, Protocol):
    """An ingest process's store: the batch side, and the queue of deferred creates."""

    def take_deferred_ingest(
        self, *, scan: int = ...
    ) -> AbstractContextManager[IngestTake | None]: ...

    def ingest_backlog(self) -> tuple[int, float]: ...


class JobLifecycle(JobMoves, ItemPages, Protocol):
    """A job's late moves: finalized with its result files once every item finished,
    cancelled, expired at its deadline, failed when left validating."""

    def jobs_in_state(self, state: JobState, limit: int = ...) -> list[str]: ...

    def jobs_with_all_items_finished(self, limit: int = ...) -> list[str]: ...

    def jobs_past_deadline(self, limit: int = ...) -> list[str]: ...

    def end_items(
        self, job_id: str, target: ItemState, *, only_unstarted: bool = ...
    ) -> list[sr.ActiveLeaseRow]: ...

    def recover_validating(
        self, created_before: datetime, errors: list[dict[str, Any]]
    ) -> dict[str, JobState]: ...

    def create_file(
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        content: None,
        *,
        size_bytes: int,
        job_id: str,
    ) -> sr.FileRecord: ...

    def delete_file(self, tenant_id: str, file_id: str) -> None: ...


class MaintenanceStore(JobLifecycle, NodeRecords, Protocol):
    """The maintenance tick's store: the job lifecycle, and the records a ledger rebuild and
    the reaper read (live attempts, nodes, the next epoch), and expired files."""

    def active_leases(self) -> list[sr.ActiveLeaseRow]: ...

    def next_ledger_epoch(self) -> int: ...

    def reap_lost(self, *, max_lost_runs: int | None = ...) -> list[sr.LostItem]: ...

    def delete_expired_files(self) -> list[str]: ...

    def purge_ended_jobs(
        self, older_than_s: float, *, chunk_rows: int = ..., max_rows: int = ...
    ) -> PurgeReport: ...


class SummaryStore(BatchStore, JobLifecycle, Protocol):
    """Summarisation jobs: their documents, steps and batches (``backfill.store.summaries``),
    and the batch side and job moves their batches are made and cancelled with
    (``backfill.summarize.driver``, ``backfill.summarize.jobs``)."""

    def create_file(  # both roles' uses: an upload, and a result file row
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        content: bytes | BinaryIO | Iterable[bytes] | None,
        *,
        size_bytes: int | None = ...,
        job_id: str | None = ...,
        chunk_bytes: int = ...,
        expires_after_s: int | None = ...,
        tokens_bound: Callable[[], int | None] | None = ...,
    ) -> sr.FileRecord: ...

    def create_summary_job(
        self,
        tenant_id: str,
        model: str,
        instruction: str,
        window: str,
        shape: JobShape,
        sampling: Mapping[str, float] | None = ...,
    ) -> SummaryJobRecord: ...

    def get_summary_job(self, tenant_id: str | None, job_id: str) -> SummaryJobRecord: ...

    def list_summary_jobs(self, tenant_id: str, limit: int = ...) -> list[SummaryJobRecord]: ...

    def add_documents(self, job_id: str, documents: Sequence[NewDocument]) -> int: ...

    def move_summary_job(
        self,
        job_id: str,
        to: SummaryJobState,
        *,
        deadline: datetime | None = ...,
        error: str | None = ...,
    ) -> None: ...

    def open_summary_jobs(self, limit: int = ...) -> list[str]: ...

    def unbatched_steps(self, job_id: str, limit: int) -> list[tuple[int, int, int]]: ...
    def step_backlog(self, job_id: str) -> StepBacklog: ...
    def has_pending_documents(self, job_id: str) -> bool: ...

    def number_batch(self, job_id: str, steps: Sequence[tuple[int, int]]) -> int: ...

    def batches_to_make(self, job_id: str) -> list[int]: ...

    def batch_steps(
        self, job_id: str, batch_no: int, page: int = ...
    ) -> Iterator[tuple[int, int, bytes]]: ...

    def set_batch(self, job_id: str, batch_no: int, batch_id: str) -> None: ...

    def summary_batch_ids(self, job_id: str) -> list[str]: ...

    def summary_jobs_of_batches(self, batch_ids: Sequence[str]) -> dict[str, str]: ...

    def finished_steps(self, job_id: str, limit: int) -> list[FinishedStep]: ...

    def end_steps(self, job_id: str, outcomes: Mapping[tuple[int, int], StepView]) -> None: ...

    def touched_documents(self, job_id: str, limit: int) -> list[tuple[int, int]]: ...

    def steps_of(self, job_id: str, seqs: Sequence[int]) -> dict[int, dict[int, StepView]]: ...

    def decide_documents(
        self,
        job_id: str,
        new_steps: Mapping[int, Sequence[NewStep]],
        ended: Mapping[int, DocumentRow],
    ) -> None: ...

    def fail_unmade_steps(self, job_id: str, error: str) -> int: ...

    def fail_pending_documents(self, job_id: str, error: str) -> int: ...

    def summary_counts(self, job_id: str) -> SummaryCounts: ...

    def document_page(self, job_id: str, after_seq: int, limit: int) -> list[DocumentRow]: ...

    def driver_lock(self, job_id: str) -> AbstractContextManager[bool]: ...
