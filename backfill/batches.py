"""Submitting batches: files in, checks, the job admitted. No HTTP here.

Order of a create, cheapest refusal first: parameters (endpoint, window, metadata) -> a
retried create (same ``Idempotency-Key``) returns the first job -> the input file ->
active-batch limit -> the tenant's token quota and deadline feasibility (at the tenant's fair
share of the throughput), on an upper bound of the file's tokens -> the model served -> the
job, ``validating``. Then its file is checked line by line and its items stored
(``backfill.batch_ingest``): in the request for a file of at most ``ingest_inline_bytes``, by
an ingest process for a larger one (the create answers ``validating`` at once, as OpenAI's
does, and no request does per-line work on a large file).
"""

from __future__ import annotations

import io
import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, BinaryIO

from backfill.batch_ingest import Admission, ingest_items, judge_tokens, stored_lines
from backfill.batch_input import PROMPT_FIELD, InputLimits, forecast_tokens_upper_bound
from backfill.config import Settings
from backfill.errors import Conflict, NotFound
from backfill.ingest_slots import RETRY_AFTER_S, TooManyIngests
from backfill.refusals import (
    IdempotencyMismatch,
    InvalidRequest,
    LimitReached,
    ModelNotFound,
    StorageCapReached,
)
from backfill.results import ERROR_STATES, OUTPUT_STATES, iter_result_lines
from backfill.states import JobState
from backfill.store import BatchStore, FileRecord, JobRecord, TenantRecord
from backfill.upload_scan import UploadScan
from backfill.windows import batch_throughput, checked_window

INPUT_PURPOSE = "batch"

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


@dataclass(frozen=True, slots=True)
class BatchRequest:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    idempotency_key: str | None = None
    output_expires_after: Any = None
    """OpenAI's ``output_expires_after`` as sent (checked by :func:`check_expires_after`)."""


MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 24 * 3600


def check_expires_after(value: Any, param: str) -> int | None:
    """OpenAI's expiration policy (``{"anchor": "created_at", "seconds": N}``, N from an
    hour to 30 days) as seconds after the file's creation; None when not given."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be an object with anchor and seconds", param=param)
    if value.get("anchor") != "created_at":
        raise InvalidRequest(f"{param}.anchor must be 'created_at'", param=f"{param}.anchor")
    seconds = value.get("seconds")
    if isinstance(seconds, str) and seconds.strip().isdigit():
        seconds = int(seconds)  # multipart form values arrive as text
    if type(seconds) is not int or not MIN_EXPIRES_AFTER_S <= seconds <= MAX_EXPIRES_AFTER_S:
        raise InvalidRequest(
            f"{param}.seconds must be an integer from {MIN_EXPIRES_AFTER_S} to "
            f"{MAX_EXPIRES_AFTER_S} (1 hour to 30 days)",
            param=f"{param}.seconds",
        )
    return seconds


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 string pairs, keys up to 64 and values up to 512 chars."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequest("metadata must be an object of strings", param="metadata")
    if len(metadata) > MAX_METADATA_KEYS:
        raise InvalidRequest(
            f"metadata has {len(metadata)} keys; at most {MAX_METADATA_KEYS} are allowed",
            param="metadata",
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidRequest("metadata keys and values must be strings", param="metadata")
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequest(
                f"metadata key {key[:20]!r}... is longer than {MAX_METADATA_KEY_CHARS} characters",
                param="metadata",
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"metadata value of {key!r} is longer than {MAX_METADATA_VALUE_CHARS} characters",
                param="metadata",
            )
    return dict(metadata)


def upload_file(
    repo: BatchStore,
    settings: Settings,
    tenant_id: str,
    *,
    filename: str,
    purpose: str,
    content: bytes | BinaryIO,
    expires_after: Any = None,
) -> FileRecord:
    """Store an input file that passes the cheap checks (size, lines, line length). It is
    read once, a piece at a time: each piece is checked as it streams into storage, and the
    first that breaks a limit refuses the file with nothing stored. The scan records the
    file's bound of forecast tokens too, so a create need not read the file for it.
    ``expires_after`` is OpenAI's expiration policy; without it the file expires after
    ``batch_file_expiry_s`` (30 days, OpenAI's default for batch files)."""
    if purpose != INPUT_PURPOSE:
        raise InvalidRequest(
            f"purpose {purpose!r} is not supported; Backfill stores files for 'batch'",
            param="purpose",
        )
    expires_after_s = check_expires_after(expires_after, "expires_after")
    if expires_after_s is None and settings.batch_file_expiry_s > 0:
        expires_after_s = settings.batch_file_expiry_s  # OpenAI's default for batch files
    cap = settings.max_stored_bytes_per_tenant
    stored = repo.tenants.stored_input_bytes(tenant_id)
    room = StorageCapReached(
        f"the tenant stores {stored} bytes of input files and may store {cap} "
        "(BACKFILL_MAX_STORED_BYTES_PER_TENANT); this file would pass that. Delete files it "
        "no longer needs"
    )
    if stored >= cap:
        raise room
    source = io.BytesIO(content) if isinstance(content, bytes) else content
    scan = UploadScan(
        source,
        InputLimits.from_settings(settings),
        piece_bytes=settings.file_chunk_bytes,
        room=room,
        room_bytes=cap - stored,
    )
    return repo.files.create_file(
        tenant_id,
        purpose,
        filename or "upload.jsonl",
        scan.pieces(),
        chunk_bytes=settings.file_chunk_bytes,
        expires_after_s=expires_after_s,
        tokens_bound=lambda: scan.tokens_bound,
    )


def file_content(repo: BatchStore, tenant_id: str, file_id: str) -> Iterator[bytes] | Iterator[str]:
    """An input file's bytes piece by piece, or an output/error file rendered from its
    job's items line by line. NotFound comes at once, before anything is streamed."""
    stored = repo.files.file_pieces(tenant_id, file_id)
    if stored is not None:
        return stored
    record = repo.files.get_file(tenant_id, file_id)
    if record.job_id is None:
        return iter(())
    job = repo.jobs.get_job(tenant_id, record.job_id)
    states = ERROR_STATES if file_id == job.error_file_id else OUTPUT_STATES
    return iter_result_lines(repo, job.id, states)


def _same_request(job: JobRecord, request: BatchRequest) -> bool:
    return (
        job.input_file_id == request.input_file_id
        and job.endpoint == request.endpoint
        and job.completion_window == request.completion_window
    )


def _retried(repo: BatchStore, tenant_id: str, job_id: str, request: BatchRequest) -> JobRecord:
    job = repo.jobs.get_job(tenant_id, job_id)
    if not _same_request(job, request):
        raise IdempotencyMismatch(
            f"Idempotency-Key {request.idempotency_key!r} was used for batch {job.id} with "
            "different parameters",
            param="Idempotency-Key",
        )
    return job


def check_active_limit(repo: BatchStore, settings: Settings, tenant_id: str) -> None:
    """:class:`LimitReached` when the tenant has as many batches active as it may (a
    summarisation job started and not ended counts as one, whatever batches it makes)."""
    active = repo.jobs.count_active_jobs(tenant_id)
    if active >= settings.max_active_batches_per_tenant:
        raise LimitReached(
            f"{active} batches are active; the limit is {settings.max_active_batches_per_tenant}"
            " per tenant (a summary job counts as one). Wait for one to finish or cancel one."
        )


def check_deferred_limit(repo: BatchStore, settings: Settings, tenant_id: str) -> None:
    """:class:`TooManyIngests` (429, ``Retry-After``) when the tenant has as many creates
    waiting for an ingest process, or in one, as it may."""
    waiting = repo.jobs.deferred_creates(tenant_id)
    cap = settings.max_deferred_creates_per_tenant
    if waiting >= cap:
        raise TooManyIngests(
            f"this tenant has {waiting} batch creates waiting for their files to be checked "
            f"and stored (at most {cap} at once, BACKFILL_MAX_DEFERRED_CREATES_PER_TENANT); "
            "retry after the time in Retry-After",
            retry_after_s=RETRY_AFTER_S,
        )


def create_batch(
    repo: BatchStore,
    settings: Settings,
    tenant: TenantRecord,
    request: BatchRequest,
    *,
    now: datetime | None = None,
    measured_tps: float | None = None,
) -> JobRecord:
    """Check and admit a batch; returns it ``in_progress`` (or ``failed`` for bad input), or
    ``validating`` when an ingest process is to check and store its file."""
    fields = _request_fields(request, settings)
    if request.idempotency_key is not None:
        first = repo.jobs.job_id_for_idempotency_key(tenant.id, request.idempotency_key)
        if first is not None:
            return _retried(repo, tenant.id, first, request)
    record = _input_file(repo, settings, tenant, request)

    # The file is read from storage a piece at a time by each pass over it, never whole.
    def content() -> Iterator[bytes]:
        return stored_lines(repo, tenant.id, record.id)

    # Quota and deadline are judged before anything is stored, on an upper bound of the
    # file's forecast tokens (the upload's scan recorded it; a file uploaded before is
    # scanned now), so a refusal is a clean 4xx with no job.
    forecast = record.tokens_bound
    if forecast is None:
        forecast = forecast_tokens_upper_bound(content())
    # Postgres' clock: the deadline is stored there and judged there (this host's may be off).
    now = now or repo.now()
    admission = Admission(
        forecast=forecast,
        now=now,
        window_s=fields.window_s,
        throughput_tps=batch_throughput(settings.batch_throughput_tokens_per_s, measured_tps),
        completion_window=request.completion_window,
    )
    plan = judge_tokens(repo, settings, tenant, forecast, admission)

    model = _first_model_of(repo, tenant.id, record.id, content)
    _check_model_served(repo, settings, model, request.endpoint)
    # A file past the inline bound is checked and stored by an ingest process: the create
    # answers validating now, and no request does per-line work on a large file.
    deferred = record.size_bytes > settings.ingest_inline_bytes
    job = repo.jobs.create_job(
        tenant.id,
        record.id,
        request.endpoint,
        request.completion_window,
        now + timedelta(seconds=fields.window_s),
        metadata=fields.metadata,
        idempotency_key=request.idempotency_key,
        model=model,
        output_expires_after_s=fields.output_expires_after_s,
        ingest_deferred=deferred,
    )
    if request.idempotency_key is not None and (
        job.state is not JobState.VALIDATING or not _same_request(job, request)
    ):
        # A concurrent create with the same key won the insert: answer with its job.
        return _retried(repo, tenant.id, job.id, request)
    if deferred:
        return job
    try:
        return ingest_items(repo, settings, tenant, job, admission, plan)
    except Conflict:
        # A concurrent create with the same Idempotency-Key stored the items first.
        return _retried(repo, tenant.id, job.id, request)


@dataclass(frozen=True, slots=True)
class _RequestFields:
    """A create request's own fields, checked (nothing read from the store)."""

    window_s: int
    metadata: dict[str, str] | None
    output_expires_after_s: int | None


def _request_fields(request: BatchRequest, settings: Settings) -> _RequestFields:
    """The endpoint, completion window, metadata and output expiry of ``request``, checked
    before anything is read: a bad one is a 400 naming its field."""
    if request.endpoint not in PROMPT_FIELD:
        raise InvalidRequest(
            f"endpoint {request.endpoint!r} is not supported; use one of "
            + ", ".join(sorted(PROMPT_FIELD)),
            code="invalid_endpoint",
            param="endpoint",
        )
    window_s = checked_window(
        request.completion_window,
        settings.min_completion_window_s,
        settings.max_completion_window_s,
    )
    metadata = check_metadata(request.metadata)
    output_expires_after_s = check_expires_after(
        request.output_expires_after, "output_expires_after"
    )
    return _RequestFields(window_s, metadata, output_expires_after_s)


def _input_file(
    repo: BatchStore, settings: Settings, tenant: TenantRecord, request: BatchRequest
) -> FileRecord:
    """The batch's input file, if the tenant may start a batch from it: a 'batch' file not
    used before, with the tenant under its stored-items and active-batches caps."""
    try:
        record = repo.files.get_file(tenant.id, request.input_file_id)
    except NotFound as exc:
        raise NotFound(
            f"No such File object: {request.input_file_id}", param="input_file_id"
        ) from exc
    if record.purpose != INPUT_PURPOSE or record.job_id is not None:
        raise InvalidRequest(
            f"file {record.id} has purpose {record.purpose!r}; a batch needs a 'batch' file",
            code="invalid_input_file",
            param="input_file_id",
        )
    if record.size_bytes > settings.ingest_inline_bytes:
        check_deferred_limit(repo, settings, tenant.id)
    stored_items = repo.tenants.stored_items(tenant.id)
    if stored_items >= settings.max_stored_items_per_tenant:
        raise StorageCapReached(
            f"the tenant stores {stored_items} batch items and may store "
            f"{settings.max_stored_items_per_tenant} (finished batches count until they are "
            "purged, BACKFILL_RETENTION_S after they end)"
        )
    check_active_limit(repo, settings, tenant.id)
    return record


def _check_model_served(
    repo: BatchStore, settings: Settings, model: str | None, endpoint: str
) -> None:
    """Refuse a batch whose model no live node serves, naming those served, unless batches
    may wait for one (``batch_wait_for_model``) or no node is live at all (the fleet is
    starting or down: the batch waits rather than being lost); and one whose model the live
    nodes serve, but not for its endpoint (an embedding model asked to chat, or the
    reverse), naming the endpoints it is served for."""
    if model is None or settings.batch_wait_for_model:
        return
    served, any_live = repo.nodes.served_models(settings.node_live_s)
    if not any_live:
        return
    if model not in served:
        raise ModelNotFound(
            f"The model `{model}` is not served by any node; served: "
            + ", ".join(f"`{m}`" for m in sorted(served)),
            param="model",
        )
    endpoints = repo.nodes.served_endpoints(model, settings.node_live_s)
    if endpoints is not None and endpoint not in endpoints:
        raise ModelNotFound(
            f"The model `{model}` is not served for {endpoint}; it is served for: "
            + (", ".join(sorted(endpoints)) or "no batch endpoint"),
            param="model",
        )


FIRST_MODEL_HEAD_BYTES = 64 * 1024
"""What a create reads of its file for the first line's model: a head, not a whole piece (a
piece is a MiB: read, sent and split on every create, it was most of a create's cost)."""


def _first_model_of(
    repo: BatchStore, tenant_id: str, file_id: str, content: Callable[[], Iterator[bytes]]
) -> str | None:
    """:func:`first_model` of the stored file, from its head's complete lines; from its lines
    read in pieces only when the head holds no complete line but blank ones."""
    head = repo.files.file_head(tenant_id, file_id, FIRST_MODEL_HEAD_BYTES)
    lines = head if len(head) < FIRST_MODEL_HEAD_BYTES else head.rpartition(b"\n")[0]
    if lines.strip():
        return first_model(lines)
    return first_model(content())


def first_model(content: bytes | Iterable[bytes]) -> str | None:
    """``body.model`` of the first request line (a batch runs one model; validation checks
    the rest), or None if that line is not a request at all: bytes, or the file's lines."""
    lines = content.split(b"\n", 64) if isinstance(content, bytes) else content
    for raw in itertools.islice(lines, 64):
        if raw.strip():
            try:
                model = json.loads(raw).get("body", {}).get("model")
            except (ValueError, AttributeError, RecursionError):
                return None
            return model if isinstance(model, str) and len(model) <= 500 else None
    return None
