"""The summarisation jobs' tables (``backfill.summarize``): a job, its documents, the model
calls (steps) they make, and the batches that carry those steps."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    false,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from backfill.models.base import TZ, Base, in_list
from backfill.summarize.states import DocumentState, StepState, SummaryJobState


class SummaryJob(Base):
    """A summarisation job: documents in, one summary each out, its steps run in batches of
    its own under its one deadline (``backfill.summarize``)."""

    __tablename__ = "summary_jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    model: Mapped[str] = mapped_column(String(500))
    instruction: Mapped[str] = mapped_column(Text)
    completion_window: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16), server_default=SummaryJobState.RECEIVING.value)
    # The job's shape (backfill.summarize.job_plan.JobShape), fixed at its create.
    summary_tokens: Mapped[int] = mapped_column(Integer)
    context_tokens: Mapped[int] = mapped_column(Integer)
    map_prompt_tokens: Mapped[int] = mapped_column(Integer)
    reduce_prompt_tokens: Mapped[int] = mapped_column(Integer)
    fan_in: Mapped[int] = mapped_column(Integer)
    # Sampling settings every step's request gets (temperature, repetition_penalty, ...).
    sampling: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    # Every step the documents received can make, reduce steps at their bound.
    forecast_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # Model calls those documents make, map and reduce (progress is steps ended of these).
    planned_steps: Mapped[int] = mapped_column(BigInteger, server_default="0")
    deadline: Mapped[datetime | None] = mapped_column(TZ)
    # Started before its last document: it takes more while it runs, and cannot complete
    # until it is closed (``POST .../close``).
    documents_open: Mapped[bool] = mapped_column(Boolean, server_default=false())
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(TZ)
    ended_at: Mapped[datetime | None] = mapped_column(TZ)
    # The reduce driver's harvest: where its next round's window of ended items starts, and
    # when it last read every ended item (backfill.store.summaries.outcomes).
    harvest_mark: Mapped[datetime | None] = mapped_column(TZ)
    harvest_full_at: Mapped[datetime | None] = mapped_column(TZ)

    __table_args__ = (
        CheckConstraint(f"state IN ({in_list(SummaryJobState)})", name="state"),
        Index("ix_summary_jobs_tenant_created", "tenant_id", "created_at"),
        # The reduce driver's round: the jobs still running.
        Index(
            "ix_summary_jobs_open",
            "created_at",
            postgresql_where=text("state IN ('in_progress', 'cancelling')"),
        ),
    )


class SummaryDocument(Base):
    """One row of a job's source: its id there, and its summary or why it has none."""

    __tablename__ = "summary_documents"

    job_id: Mapped[str] = mapped_column(
        ForeignKey("summary_jobs.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    source_id: Mapped[str | None] = mapped_column(String(512))
    state: Mapped[str] = mapped_column(String(16), server_default=DocumentState.PENDING.value)
    chunks: Mapped[int] = mapped_column(Integer, server_default="1")
    split_depth: Mapped[int] = mapped_column(Integer, server_default="0")
    # A step of it ended since the driver last decided for it.
    touched: Mapped[bool] = mapped_column(Boolean, server_default=false())
    summary: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")

    __table_args__ = (
        CheckConstraint(f"state IN ({in_list(DocumentState)})", name="state"),
        Index("ix_summary_documents_job_state", "job_id", "state"),
        Index(
            "ix_summary_documents_touched",
            "job_id",
            "seq",
            postgresql_where=text("touched"),
        ),
    )


class SummaryStep(Base):
    """One model call of a document: a map step over a chunk (node < chunks) or a reduce
    step over the summaries of its children. Its key is what keeps a step from being made
    twice."""

    __tablename__ = "summary_steps"

    job_id: Mapped[str] = mapped_column(
        ForeignKey("summary_jobs.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Its request body (JSON), until its batch is made; the bound of its line's bytes.
    body: Mapped[str | None] = mapped_column(Text)
    line_bytes: Mapped[int] = mapped_column(Integer)
    # The job's batch that carries it (summary_batches.batch_no); NULL: not in one yet.
    batch_no: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), server_default=StepState.PENDING.value)
    summary: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    completion_tokens: Mapped[int] = mapped_column(Integer, server_default="0")

    __table_args__ = (
        CheckConstraint(f"state IN ({in_list(StepState)})", name="state"),
        Index(
            "ix_summary_steps_unbatched",
            "job_id",
            "seq",
            "node",
            postgresql_where=text("batch_no IS NULL"),
        ),
        Index(
            "ix_summary_steps_pending",
            "job_id",
            "batch_no",
            postgresql_where=text("state = 'pending'"),
        ),
    )


class SummaryBatch(Base):
    """One of a job's batches: the steps it carries are its rows in ``summary_steps``; its
    Batch API job is made once (its idempotency key names the job and the number)."""

    __tablename__ = "summary_batches"

    job_id: Mapped[str] = mapped_column(
        ForeignKey("summary_jobs.id", ondelete="CASCADE"), primary_key=True
    )
    batch_no: Mapped[int] = mapped_column(Integer, primary_key=True)
    batch_id: Mapped[str | None] = mapped_column(String(40))
    steps: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class SummaryCount(Base):
    """What statements changed of a job's counts (``kind`` ``document`` or ``step``, by
    state): written by triggers on ``summary_documents`` and ``summary_steps`` (migration
    ``0023_summary_counts``), folded by the job's driver into one row per kind and state; a
    job's counts are the sums of its rows."""

    __tablename__ = "summary_counts"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("summary_jobs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(8))
    state: Mapped[str] = mapped_column(String(16))
    n: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    split: Mapped[int] = mapped_column(BigInteger)
    deepest: Mapped[int] = mapped_column(Integer)
    unbatched: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (Index("ix_summary_counts_job", "job_id"),)
