"""The queue's tables: tenants and their keys, files, nodes, and the jobs with their
counters, items, attempts and events; the ledger's epoch.

Everything needed to rebuild the Redis ledger (active attempts with their lease ids, tokens
and fencing tokens, and each node's measured pool) lives here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import Mapped, mapped_column

from backfill.models.base import TZ, Base, in_list
from backfill.states import ITEM_ACTIVE, ITEM_CLAIMABLE, JOB_TERMINAL, ItemState, JobState

CLAIMABLE_SQL = in_list(ITEM_CLAIMABLE)
ACTIVE_SQL = in_list(ITEM_ACTIVE)
JOB_ENDED_AT = "COALESCE(completed_at, failed_at, expired_at, cancelled_at, created_at)"
"""When a job ended (its end state's stamp; the retention purge counts its period from it)."""

ATTEMPTS_FILLFACTOR = 50
"""Percent of each ``attempts`` page filled by inserts (the rest is room for HOT updates)."""


class Tenant(Base):
    """Who submits work; quotas are per tenant."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    enqueued_token_quota: Mapped[int | None] = mapped_column(BigInteger)
    # The tenant's share of each node's batch sequences, relative to the other tenants with
    # work (``backfill.fairshare``).
    weight: Mapped[float] = mapped_column(Double, server_default="1")
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (CheckConstraint("weight > 0", name="weight_positive"),)


class ApiKey(Base):
    """An API key, stored only as its SHA-256 digest."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    digest: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(TZ)

    __table_args__ = (Index("ix_api_keys_tenant", "tenant_id"),)


class File(Base):
    """An uploaded input file, or an output/error file a job produced."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(512))
    size_bytes: Mapped[int] = mapped_column("bytes", BigInteger)
    # Input files keep their bytes (in ``file_chunks``; ``content`` holds those of files
    # uploaded before chunks existed); output and error files are rendered from the items of
    # ``job_id`` when read, so results are never stored twice.
    content: Mapped[bytes | None] = mapped_column(LargeBinary)
    job_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    # OpenAI's ``expires_after`` (uploads) / the batch's ``output_expires_after`` (results):
    # from then the file is gone (reads 404, maintenance deletes it). None: kept.
    expires_at: Mapped[datetime | None] = mapped_column(TZ)
    # An upper bound of the tokens forecasts charge a batch of this input file, recorded by
    # the upload's scan so a create need not read the file for it. None: uploaded before.
    output_tokens_bound: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        Index("ix_files_tenant_created", "tenant_id", "created_at"),
        Index("ix_files_expires", "expires_at", postgresql_where=text("expires_at IS NOT NULL")),
    )


class FileChunk(Base):
    """One piece of an input file's bytes, in order (``seq`` from 0): files stream in and
    out a piece at a time, never whole in memory."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(
        ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Uncompressed and out of line (STORAGE EXTERNAL, see migration 0009): an item's body is
    # a slice of one piece (``backfill.store.bodies``), read without reading the whole piece.
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Node(Base):
    """A GPU node's engine and its measured KV pool (what the ledger is rebuilt from)."""

    __tablename__ = "nodes"

    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    engine_url: Mapped[str] = mapped_column(String(1000))
    model: Mapped[str | None] = mapped_column(String(500))
    num_blocks: Mapped[int] = mapped_column(Integer)
    block_size: Mapped[int] = mapped_column(Integer)
    interactive_reserve_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    endpoints: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    """The batch endpoints the engine serves; NULL: not asked (every endpoint)."""
    registered_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    last_seen_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())


class Job(Base):
    """A batch: one input file's requests, with one deadline."""

    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    input_file_id: Mapped[str] = mapped_column(String(40))
    endpoint: Mapped[str] = mapped_column(String(64))
    model: Mapped[str | None] = mapped_column(String(500))
    completion_window: Mapped[str] = mapped_column(String(32))
    state: Mapped[str] = mapped_column(String(16), server_default=JobState.VALIDATING.value)
    deadline: Mapped[datetime] = mapped_column(TZ)
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)
    idempotency_key: Mapped[str | None] = mapped_column(String(256))
    # The batch's ``output_expires_after`` (seconds from their creation) for its result files.
    output_expires_after_s: Mapped[int | None] = mapped_column(Integer)
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    # Validated and stored by an ingest process, not in the create's request (a large file;
    # ``backfill.ingester``); how many ingests of it began; its place among its tenant's
    # queued creates when it was made (tenants take turns in the queue).
    ingest_deferred: Mapped[bool] = mapped_column(Boolean, server_default=false())
    ingest_attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    ingest_turn: Mapped[int] = mapped_column(Integer, server_default="0")
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    in_progress_at: Mapped[datetime | None] = mapped_column(TZ)
    finalizing_at: Mapped[datetime | None] = mapped_column(TZ)
    completed_at: Mapped[datetime | None] = mapped_column(TZ)
    failed_at: Mapped[datetime | None] = mapped_column(TZ)
    expired_at: Mapped[datetime | None] = mapped_column(TZ)
    cancelling_at: Mapped[datetime | None] = mapped_column(TZ)
    cancelled_at: Mapped[datetime | None] = mapped_column(TZ)
    # When a worker took the job to find its items' shared prompt prefixes (issue 36; NULL:
    # not yet): one worker looks, once (``backfill.prefix_pass``).
    prefixes_taken_at: Mapped[datetime | None] = mapped_column(TZ)
    # When that pass ended (found, found none, or failed; NULL: not yet, or its worker died):
    # a node that looks for prefixes leaves a new job's items until then, for a bound.
    prefixes_ended_at: Mapped[datetime | None] = mapped_column(TZ)
    # The last item id that pass has recorded up to (its pages go in id order; NULL: none
    # yet): while it runs, such a node claims the items at or below it.
    prefixes_upto: Mapped[int | None] = mapped_column(BigInteger)

    __table_args__ = (
        CheckConstraint(f"state IN ({in_list(JobState)})", name="state"),
        Index("ix_jobs_tenant_created", "tenant_id", "created_at"),
        # Deleting an input file finds the batches whose items still point into it.
        Index("ix_jobs_input_file", "input_file_id"),
        # The jobs a prefix pass has yet to take: every idle node's finder asks for one.
        Index(
            "ix_jobs_prefix_pass_pending",
            "created_at",
            "id",
            postgresql_where=text("state = 'in_progress' AND prefixes_taken_at IS NULL"),
        ),
        Index(
            "uq_jobs_tenant_idempotency",
            "tenant_id",
            "idempotency_key",
            unique=True,
            postgresql_where=text("idempotency_key IS NOT NULL"),
        ),
        Index(
            "ix_jobs_open_deadline",
            "deadline",
            postgresql_where=text("state IN ('validating', 'in_progress', 'cancelling')"),
        ),
        # The ingest processes' queue: deferred creates still validating.
        Index(
            "ix_jobs_ingest_queue",
            "ingest_turn",
            "created_at",
            postgresql_where=text("state = 'validating' AND ingest_deferred"),
        ),
        # The retention purge's ended jobs, oldest end first: a month of them is kept.
        Index(
            "ix_jobs_ended",
            text(JOB_ENDED_AT),
            postgresql_where=text(f"state IN ({in_list(JOB_TERMINAL)})"),
        ),
        # The fair-share claim asks which tenants have work (jobs in progress).
        Index(
            "ix_jobs_in_progress_tenant",
            "tenant_id",
            postgresql_where=text("state = 'in_progress'"),
        ),
    )


class JobCounters(Base):
    """Items per state and token totals of one job, kept in step with every transition.

    Status reads sum a job's few shard rows, never COUNT(*) over its items. Each database
    connection writes its own shard, so concurrent workers do not serialise on one row lock.
    """

    __tablename__ = "job_counters"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    shard: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    total: Mapped[int] = mapped_column(Integer, server_default="0")
    queued: Mapped[int] = mapped_column(Integer, server_default="0")
    deferred: Mapped[int] = mapped_column(Integer, server_default="0")
    reserved: Mapped[int] = mapped_column(Integer, server_default="0")
    running: Mapped[int] = mapped_column(Integer, server_default="0")
    preempted: Mapped[int] = mapped_column(Integer, server_default="0")
    succeeded: Mapped[int] = mapped_column(Integer, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, server_default="0")
    expired: Mapped[int] = mapped_column(Integer, server_default="0")
    cancelled: Mapped[int] = mapped_column(Integer, server_default="0")
    # Token totals for progress and ETA: the declared worst case, and what was produced.
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    max_output_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # Prompt tokens of the items that succeeded: the Batch object's usage.input_tokens.
    input_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")
    output_tokens: Mapped[int] = mapped_column(BigInteger, server_default="0")


class Item(Base):
    """One request line of a batch."""

    __tablename__ = "items"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    # The job's tenant, copied at ingest so a claim finds a tenant's items by index alone.
    tenant_id: Mapped[str] = mapped_column(String(40))
    line_no: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(512))
    # The request body (JSON text; lz4-compressed column, see migration), or NULL while the
    # item's line in the input file stands for it: piece ``body_seq``, bytes ``body_at`` to
    # ``body_at + body_len`` (``backfill.store.bodies``).
    body: Mapped[str | None] = mapped_column(Text)
    body_seq: Mapped[int | None] = mapped_column(Integer)
    body_at: Mapped[int | None] = mapped_column(Integer)
    body_len: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    max_output_tokens: Mapped[int] = mapped_column(Integer)
    # The line gave no output budget: ``max_output_tokens`` is what ingest could reserve (the
    # default, or less where the prompt's lower bound leaves less), and each run gets no more
    # than the class limit leaves its exact prompt (``backfill.output_budget``).
    output_defaulted: Mapped[bool] = mapped_column(Boolean, server_default=false())
    reservation_tokens: Mapped[int | None] = mapped_column(Integer)
    # The shared prompt prefix the item starts with (``backfill.prefixes``): its id and its
    # length in whole KV blocks; NULL where it shares none or none is found yet.
    prefix_id: Mapped[str | None] = mapped_column(String(32))
    prefix_blocks: Mapped[int | None] = mapped_column(Integer)
    # What of the current lease is the shared prefix, held once by the node's ledger (0: the
    # lease holds the whole prompt); a rebuild refers the lease to its prefix again.
    lease_prefix_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    state: Mapped[str] = mapped_column(String(16), server_default=ItemState.QUEUED.value)
    deadline: Mapped[datetime] = mapped_column(TZ)
    # The attempt number doubles as the Postgres-side fencing token: every guarded write of
    # an attempt names it, so a write from an older attempt matches no row.
    attempt: Mapped[int] = mapped_column(Integer, server_default="0")
    fencing_token: Mapped[int | None] = mapped_column(BigInteger)
    node: Mapped[str | None] = mapped_column(String(200))
    lease_id: Mapped[str | None] = mapped_column(String(64))
    lease_expires_at: Mapped[datetime | None] = mapped_column(TZ)
    not_before: Mapped[datetime | None] = mapped_column(TZ)
    preemptions: Mapped[int] = mapped_column(Integer, server_default="0")
    partial_output: Mapped[str | None] = mapped_column(Text)
    partial_tokens: Mapped[int] = mapped_column(Integer, server_default="0")
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    result: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    started_at: Mapped[datetime | None] = mapped_column(TZ)
    finished_at: Mapped[datetime | None] = mapped_column(TZ)
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        CheckConstraint(f"state IN ({in_list(ItemState)})", name="state"),
        # 0: an embedding (it generates nothing).
        CheckConstraint("max_output_tokens >= 0", name="max_output_not_negative"),
        CheckConstraint(
            "body IS NOT NULL OR (body_seq IS NOT NULL AND body_at IS NOT NULL "
            "AND body_len IS NOT NULL)",
            name="body_kept",
        ),
        CheckConstraint(
            "(prefix_id IS NULL) = (prefix_blocks IS NULL) AND "
            "(prefix_blocks IS NULL OR prefix_blocks >= 1)",
            name="prefix_whole",
        ),
        UniqueConstraint("job_id", "custom_id"),
        Index("ix_items_job_state", "job_id", "state"),
        Index("ix_items_job_line", "job_id", "line_no"),
        # A job's shared prefixes (the Batch object's backfill.prefixes): only the grouped
        # items, so a batch without groups reads none of its items for them.
        Index(
            "ix_items_job_prefix",
            "job_id",
            "prefix_id",
            "prefix_blocks",
            postgresql_where=text("prefix_id IS NOT NULL"),
        ),
        # Earliest-deadline-first claim walks this index only.
        Index(
            "ix_items_claim_edf",
            "deadline",
            "id",
            postgresql_where=text(f"state IN ({CLAIMABLE_SQL})"),
        ),
        # The fair-share claim takes each tenant's quota, earliest deadline first, from here.
        Index(
            "ix_items_claim_tenant",
            "tenant_id",
            "deadline",
            "id",
            postgresql_where=text(f"state IN ({CLAIMABLE_SQL})"),
        ),
        # What a node holds for each tenant: the fair share's use.
        Index(
            "ix_items_node_active",
            "node",
            "tenant_id",
            postgresql_where=text(f"state IN ({ACTIVE_SQL})"),
        ),
        # The reaper finds attempts whose worker stopped heartbeating.
        Index(
            "ix_items_active_lease",
            "lease_expires_at",
            postgresql_where=text(f"state IN ({ACTIVE_SQL})"),
        ),
        # /metrics reads what finished since its last scrape.
        Index(
            "ix_items_finished_at",
            "finished_at",
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
        # A summarisation job's harvest reads what of its batches ended since its last round.
        Index(
            "ix_items_job_finished",
            "job_id",
            "finished_at",
            postgresql_where=text("finished_at IS NOT NULL"),
        ),
    )


class Attempt(Base):
    """One worker's try at an item: the audit trail and what the ledger is rebuilt from."""

    __tablename__ = "attempts"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    item_id: Mapped[int] = mapped_column(ForeignKey("items.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    node: Mapped[str] = mapped_column(String(200))
    lease_id: Mapped[str | None] = mapped_column(String(64))
    fencing_token: Mapped[int | None] = mapped_column(BigInteger)
    reserved_tokens: Mapped[int | None] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    ended_at: Mapped[datetime | None] = mapped_column(TZ)
    outcome: Mapped[str | None] = mapped_column(String(16))
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    detail: Mapped[str | None] = mapped_column(Text)

    # Half of each page left free: an attempt's row is written at its start and updated at
    # its end, and with room on its page (and no index on what changes) that update is a
    # HOT one, which writes no index entry (migration 0009).
    __table_args__ = (
        UniqueConstraint("item_id", "attempt"),
        {"postgresql_with": {"fillfactor": ATTEMPTS_FILLFACTOR}},
    )


class JobEvent(Base):
    """The audit trail of a job's state changes."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_job_events_job_at", "job_id", "at"),)


class LedgerEpoch(Base):
    """The last epoch of the Redis ledger; each rebuild takes the next one."""

    __tablename__ = "ledger_epochs"

    id: Mapped[int] = mapped_column(SmallInteger, primary_key=True)
    epoch: Mapped[int] = mapped_column(BigInteger)
