"""What the API takes in and how long it keeps it: an input file's and a request body's limits,
what one tenant may have open and stored, the ingest processes that check large files, the
retention of ended work, and the completion windows and sequence lengths a batch may ask for."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from backfill.config.fields import PositiveFloat, PositiveInt


class IntakeSettings(BaseModel):
    """Limits on what comes in, each tenant's caps, ingest and retention."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    max_file_bytes: PositiveInt = 200 * 1024 * 1024
    """an input file's limits: its size"""
    max_line_bytes: PositiveInt = 1024 * 1024
    """an input file's limits: one line's size"""
    max_lines_per_batch: PositiveInt = 100_000
    """an input file's limits: its lines"""
    max_active_batches_per_tenant: PositiveInt = 100
    """batches a tenant may have open at once (a summary job started and not ended counts as
    one, its own batches not at all); one more is a 429 (`active_batch_limit_reached`)"""
    max_stored_items_per_tenant: PositiveInt = 10_000_000
    """what one tenant may keep stored: batch items in any state (finished ones count until
    their batch is purged, `BACKFILL_RETENTION_S` after it ends); past it, uploads and creates
    are a 429 (`storage_cap_reached`, not retried) and a batch whose items would pass the cap
    fails naming it"""
    max_stored_bytes_per_tenant: PositiveInt = 100 * 1024**3
    """what one tenant may keep stored: input file bytes (until deleted or expired); past it,
    uploads and creates are a 429 (`storage_cap_reached`, not retried)"""
    max_ingests_per_tenant: PositiveInt = 2
    """file uploads and batch creates one API process works on at once for one tenant (each
    holds a Postgres connection while it checks and stores a file); beyond, a 429 with
    `Retry-After` (`too_many_concurrent_ingests`) before any work"""
    max_ingests: PositiveInt = 6
    """... and in all, well under the API's pool (10 + 10 overflow) so reads always find a
    connection; beyond, a 429 with `Retry-After` (`too_many_concurrent_ingests`)"""
    ingest_inline_bytes: Annotated[int, Field(ge=0)] = 0
    """a batch whose input file is larger is checked and stored by an ingest process (at the
    lowest CPU priority), not in the create's request: the create answers `validating` at
    once, as OpenAI's does, and the batch moves to `in_progress` (or `failed`, naming each bad
    line) when its ingest is done; `0` (the default) defers every create (checked in the
    request, a flood of one tenant's 1 MiB creates raised another tenant's read p99 25x, the
    express lane's deferral 2.2-2.4x: `bench.isolation --lines 2900 --lists 0`)"""
    ingest_express_bytes: Annotated[int, Field(ge=0)] = 8 * 1024 * 1024
    """a deferred create whose file is at most this goes by each ingest process's express
    lane, one at a time beside its main loop (which takes the larger ones, two at once): it is
    checked and stored in moments, never behind another tenant's large file's COPY; `0`: no
    express lane"""
    ingesters: Annotated[int, Field(ge=0)] = 1
    """ingest processes each API process starts (at the lowest CPU priority; `backfill api`
    starts them with it); `0`: none, run `backfill ingest` beside instead (any number: each
    reads one batch's file at a time while it stores the one before, tenants in turn; an
    ingest that dies is begun again, up to 3 times)"""
    max_deferred_creates_per_tenant: PositiveInt = 4
    """a tenant's creates answered `validating` and not yet checked and stored (waiting for an
    ingest process, or in one) at once; one more is a 429 `too_many_concurrent_ingests` with
    `Retry-After`, answered before the create's other work"""
    tenant_requests_in_progress: Annotated[int, Field(ge=0)] = 4
    """`/v1/` requests of one tenant an API process works on at once (uploads and interactive
    requests aside); more wait their turn, then a 429 `too_many_requests_in_progress` with
    `Retry-After`; `0`: no bound"""
    retention_s: Annotated[float, Field(ge=0)] = 30 * 86_400.0
    """a batch that ended this long ago is purged by the maintenance tick with its items,
    attempts, webhook events and deliveries, and result files, and a summary job with its
    documents and steps (`0` keeps everything; OpenAI keeps batch data 30 days)"""
    retention_chunk_rows: PositiveInt = 5_000
    """rows one purge transaction deletes at most (each is sized from the last one's time:
    halved while one takes longer than `BACKFILL_RETENTION_CHUNK_TARGET_S`, down to 100,
    doubled up to this while one takes under half of it; a process's first deletes 100)"""
    retention_chunk_target_s: PositiveFloat = 0.2
    """how long one purge transaction should take: each is sized from the last one's time, so
    that a slow server's purge holds its locks no longer than a quiet one's"""
    retention_tick_budget_s: PositiveFloat = 1.0
    """how long one maintenance tick purges: it starts no transaction after this, and the
    next tick goes on where it stopped"""
    retention_rows_per_tick: PositiveInt = 50_000
    """rows one maintenance tick purges at most, however fast they go"""
    batch_file_expiry_s: Annotated[int, Field(ge=0)] = 30 * 86_400
    """when an input file uploaded without `expires_after` expires, as at OpenAI (`0`: kept
    until deleted)"""
    max_interactive_body_bytes: PositiveInt = 4 * 1024 * 1024
    """request bodies of the gateway (bytes read, chunked or not)"""
    max_json_body_bytes: PositiveInt = 64 * 1024
    """request bodies of every other JSON route (bytes read, chunked or not; an upload may
    carry `BACKFILL_MAX_FILE_BYTES` and its multipart envelope)"""
    file_chunk_bytes: Annotated[int, Field(ge=4096)] = 1024 * 1024
    """files stream through the API (and are stored) in pieces of this size: what one file
    costs the API in memory, whatever its size"""
    batch_max_sequence_tokens: PositiveInt = 32_768
    """prompt + max_tokens limit of a batch item"""
    max_bytes_per_token: PositiveInt = 128
    """the longest token of the served vocabularies, in bytes: a prompt's bytes over it are a
    lower bound of its tokens, so the API refuses only what is certainly too long"""

    min_completion_window_s: PositiveInt = 5 * 60
    """the shortest completion window a batch may ask for"""
    max_completion_window_s: PositiveInt = 7 * 24 * 3600
    """the longest completion window a batch may ask for"""
    local_token_counts: bool = True
    """count a summarisation job's documents, and the plain prompts of interactive requests
    (completions; a chat's template stays the engine's), with the model's own tokenizer file
    where the process can read it (the folder the engine names as its model's ``root``: always
    for the engine gate), checked against the engine's counts, instead of asking the engine's
    ``/tokenize`` for each"""
    batch_throughput_tokens_per_s: PositiveFloat = 5_000.0
    """the deployment's batch decode throughput, for deadline feasibility until workers report
    a measured rate"""
