"""Records the store returns and takes: plain frozen values (no ORM session escapes the store)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from backfill.states import ITEM_TERMINAL, ItemState, JobState


@dataclass(frozen=True, slots=True)
class TenantRecord:
    id: str
    name: str
    enqueued_token_quota: int | None
    weight: float = 1.0
    """Share of each node's batch sequences relative to the other tenants with work."""


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    key_id: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class RevokedKey:
    key_id: str
    digest: str
    """What key caches know the key by (announced so every API process forgets it)."""
    tenant: str


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    tenant_id: str
    purpose: str
    filename: str
    size_bytes: int
    job_id: str | None
    created_at: datetime
    expires_at: datetime | None = None
    tokens_bound: int | None = None
    """An upper bound of the tokens forecasts charge a batch of this input file, recorded
    by the upload's scan; None: not recorded (uploaded before, or not an input file)."""


@dataclass(frozen=True, slots=True)
class FilePage:
    """A page of a tenant's files as OpenAI's File list wants them, its objects' JSON written
    by Postgres (``Files.list_files_page``)."""

    data: str
    """The page's File objects as JSON, comma-separated, in the page's order."""
    first_id: str | None
    last_id: str | None
    has_more: bool


@dataclass(frozen=True, slots=True)
class JobCounts:
    """Items per state and token totals of one job (the ``job_counters`` row)."""

    total: int = 0
    by_state: dict[ItemState, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    max_output_tokens: int = 0
    output_tokens: int = 0
    input_tokens: int = 0
    """Prompt tokens of the requests that succeeded (the Batch object's usage)."""

    def count(self, state: ItemState) -> int:
        return self.by_state.get(state, 0)

    @property
    def finished(self) -> int:
        return sum(self.count(s) for s in ITEM_TERMINAL)

    @property
    def unfinished(self) -> int:
        return self.total - self.finished


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    tenant_id: str
    input_file_id: str
    endpoint: str
    model: str | None
    completion_window: str
    state: JobState
    deadline: datetime
    metadata: dict[str, Any] | None
    errors: list[dict[str, Any]] | None
    idempotency_key: str | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    timestamps: dict[str, datetime | None]
    counts: JobCounts


@dataclass(frozen=True, slots=True)
class FinishedTokenStats:
    """Token figures of the items that succeeded in one window (for the metrics)."""

    until: datetime
    """The window's end, by the database's clock: the next window starts here."""
    count: int
    prompt_sum: int
    output_sum: int
    prompt_le: list[int]
    """Items with at most each bound's prompt tokens (cumulative, as Prometheus buckets)."""
    output_le: list[int]


@dataclass(frozen=True, slots=True)
class NewItem:
    """One request line to store, as validated by the API: with its body, or (``body``
    None) with where the body's bytes lie in the job's input file
    (``backfill.store.bodies``)."""

    line_no: int
    custom_id: str
    body: str | None
    max_output_tokens: int
    prompt_tokens: int | None = None
    reservation_tokens: int | None = None
    output_defaulted: bool = False
    """The line gave no output budget: ``max_output_tokens`` is what ingest reserved for it
    (``backfill.batch_input``), fitted to the exact prompt at each run."""
    body_seq: int | None = None
    """The input file's piece (``file_chunks.seq``) that holds the body's bytes."""
    body_at: int | None = None
    """The body's first byte in that piece."""
    body_len: int | None = None
    """The body's bytes."""


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    """An item handed to one worker attempt (state ``reserved``)."""

    id: int
    job_id: str
    attempt: int
    custom_id: str
    body: str
    deadline: datetime
    prompt_tokens: int | None
    max_output_tokens: int
    reservation_tokens: int | None
    preemptions: int
    partial_output: str | None
    partial_tokens: int
    endpoint: str
    deadline_left_s: float
    """Seconds to ``deadline`` at the claim, on Postgres' clock: what a worker judges the
    deadline by (its own clock may be off; the claim's age it measures on its monotonic one)."""
    tenant_id: str = ""
    """Whose batch it is (its requests carry the tenant's ``cache_salt``)."""
    output_defaulted: bool = False
    """The line gave no output budget: each run may generate what is left of
    ``max_output_tokens`` and no more than the class limit leaves its exact prompt
    (``backfill.output_budget``)."""
    prefix_id: str | None = None
    """The shared prompt prefix the item starts with (``backfill.prefixes``), if found."""
    prefix_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class Start:
    """A claimed item about to run under a ledger lease."""

    item_id: int
    attempt: int
    lease_id: str
    fencing_token: int
    reservation_tokens: int
    prompt_tokens: int
    prefix_tokens: int = 0
    """What of the lease is the item's shared prefix, held once by the node's ledger."""


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a running attempt: success with a result, or failure with an error."""

    item_id: int
    attempt: int
    fencing_token: int
    state: ItemState  # SUCCEEDED or FAILED
    result: str | None = None
    error: str | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ActiveLeaseRow:
    """An item held by a live attempt, as the ledger needs it for a rebuild."""

    item_id: int
    node: str
    attempt: int
    lease_id: str | None
    fencing_token: int | None
    reservation_tokens: int | None
    lease_expires_at: datetime | None
    deadline: datetime
    preemptions: int
    partial_tokens: int
    prefix_id: str | None = None
    lease_prefix_tokens: int = 0
    """What of the lease is the item's shared prefix (0: none): held once by the ledger."""


@dataclass(frozen=True, slots=True)
class LostItem(ActiveLeaseRow):
    """An item the reaper took back from a silent attempt: requeued, or failed when its
    worker died under it as often as the attempt cap allows."""

    failed: bool = False


@dataclass(frozen=True, slots=True)
class ItemRecord:
    id: int
    job_id: str
    line_no: int
    custom_id: str
    state: ItemState
    attempt: int
    result: str | None
    error: str | None
    output_tokens: int | None
    preemptions: int


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    engine_url: str
    model: str | None
    num_blocks: int
    block_size: int
    interactive_reserve_tokens: int
    last_seen_at: datetime
    endpoints: tuple[str, ...] | None = None
    """The batch endpoints its engine serves; None: the worker did not say (every one)."""

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
