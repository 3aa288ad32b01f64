"""The records the summary store returns and takes: plain frozen values (no ORM session escapes
the store)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from backfill.summarize.job_plan import JobShape
from backfill.summarize.states import DocumentState, StepState, SummaryJobState


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
    documents_open: bool = False
    """Started before its last document: it still takes documents, and cannot complete
    until it is closed."""


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
