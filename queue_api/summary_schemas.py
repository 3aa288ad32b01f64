"""Wire shapes of ``/v1/summary_jobs``: a summarisation job as a resource of its own."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from backfill.store.summaries import SummaryJobRecord
from backfill.summarize.jobs import SummaryProgress
from backfill.summarize.prompts import DEFAULT_INSTRUCTION
from queue_api.schemas import unix


class CreateSummaryJobBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    instruction: str = DEFAULT_INSTRUCTION
    max_summary_tokens: int = Field(default=256, ge=1)
    completion_window: str = "24h"
    sampling: dict[str, float] = Field(default_factory=dict)
    """Sampling settings every step's request gets: temperature, top_p, top_k, min_p,
    repetition_penalty, frequency_penalty, presence_penalty."""


class StartSummaryJobBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    more_documents: bool = False
    """Start before the last document: the job runs what it has while the rest are sent
    (each request judged against its deadline as it comes), and completes once closed
    (``POST .../close``)."""
    expected_documents: int | None = Field(default=None, ge=1)
    """With ``more_documents``: how many documents the job will have in all, where the
    client knows. The start then judges the whole job's deadline, its forecast scaled from
    the documents received, instead of only theirs."""


class SummaryJobProgress(BaseModel):
    documents: dict[str, int]
    """Documents per state: pending, succeeded, failed."""
    steps_done: int
    steps_planned: int
    """Model calls the documents make, map and reduce."""
    prompt_tokens: int
    completion_tokens: int
    eta: int | None = None
    split_documents: int = 0
    """Documents longer than one prompt: split into chunks and map-reduced."""
    deepest_split: int = 0
    """The most reduce levels above one document's chunks."""


class SummaryJobObject(BaseModel):
    id: str
    object: Literal["summary_job"] = "summary_job"
    model: str
    instruction: str
    status: str
    completion_window: str
    max_summary_tokens: int
    sampling: dict[str, float]
    context_tokens: int
    fan_in: int
    """Summaries one reduce step combines."""
    forecast_tokens: int
    created_at: int
    in_progress_at: int | None = None
    ended_at: int | None = None
    expires_at: int | None = None
    documents_open: bool = False
    """Started with more documents to come: it takes them until closed."""
    error: str | None = None
    progress: SummaryJobProgress
    batches: list[str]

    @classmethod
    def of(
        cls, job: SummaryJobRecord, progress: SummaryProgress, batches: list[str]
    ) -> SummaryJobObject:
        return cls(
            id=job.id,
            model=job.model,
            instruction=job.instruction,
            status=job.state.value,
            completion_window=job.completion_window,
            max_summary_tokens=job.shape.summary_tokens,
            sampling=job.sampling,
            context_tokens=job.shape.context_tokens,
            fan_in=job.fan_in,
            forecast_tokens=job.forecast_tokens,
            created_at=unix(job.created_at) or 0,
            in_progress_at=unix(job.started_at),
            ended_at=unix(job.ended_at),
            expires_at=unix(job.deadline),
            documents_open=job.documents_open,
            error=job.error,
            progress=SummaryJobProgress(
                documents=progress.documents,
                steps_done=progress.steps_done,
                steps_planned=progress.steps_planned,
                prompt_tokens=progress.prompt_tokens,
                completion_tokens=progress.completion_tokens,
                eta=unix(progress.eta),
                split_documents=progress.split_documents,
                deepest_split=progress.deepest_split,
            ),
            batches=batches,
        )


class DocumentsAdded(BaseModel):
    object: Literal["summary_job.documents"] = "summary_job.documents"
    first: int
    """The number (position in the job) of the first document of this request."""
    received: int
    failed: int
    """Of those, rows that are not summarised (their errors are in the results)."""
    split: int
    """Of those, documents longer than one prompt: split into chunks and map-reduced."""


class SummaryJobList(BaseModel):
    object: Literal["list"] = "list"
    data: list[SummaryJobObject]
    has_more: bool = False
