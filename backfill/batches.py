"""Submitting batches: files in, checks, items stored, job in progress. No HTTP here.

Order of a create, cheapest refusal first: parameters (endpoint, window, metadata) -> a
retried create (same ``Idempotency-Key``) returns the first job -> the input file ->
active-batch limit -> the tenant's token quota and deadline feasibility (at the tenant's fair
share of the throughput), on an upper bound of the file's tokens -> the job, then every line
parsed and checked while it streams into one COPY, whose transaction also moves the job to
``in_progress``. The first bad line aborts the COPY (nothing of the file is stored) and the job
ends ``failed`` with ``errors`` naming each bad line, as OpenAI's Batch API does. A cancel
during validation takes effect at once; the create then stores nothing (see
``Repository.insert_items``).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, BinaryIO

from backfill.batch_input import (
    PROMPT_FIELD,
    InputLimits,
    InputLines,
    InvalidBatch,
    LineInvalid,
    LocatedLines,
    Tally,
    forecast_tokens_upper_bound,
    stream_valid_items,
    validate_batch_input,
)
from backfill.config import Settings
from backfill.errors import Conflict, NotFound, StaleWrite
from backfill.fairshare import tokens_until_done
from backfill.refusals import (
    DeadlineInfeasible,
    IdempotencyMismatch,
    InvalidRequest,
    LimitReached,
    ModelNotFound,
    QuotaExceeded,
    Refusal,
)
from backfill.results import ERROR_STATES, OUTPUT_STATES, iter_result_lines
from backfill.states import JobState
from backfill.store import BatchStore, FileRecord, JobRecord, NewItem, TenantRecord
from backfill.upload_scan import UploadScan, iter_lines, iter_located_lines, read_ahead
from backfill.windows import (
    DeadlinePlan,
    batch_throughput,
    checked_window,
    format_window,
    plan_deadline,
)

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
    source = io.BytesIO(content) if isinstance(content, bytes) else content
    scan = UploadScan(
        source, InputLimits.from_settings(settings), piece_bytes=settings.file_chunk_bytes
    )
    return repo.create_file(
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
    stored = repo.file_pieces(tenant_id, file_id)
    if stored is not None:
        return stored
    record = repo.get_file(tenant_id, file_id)
    if record.job_id is None:
        return iter(())
    job = repo.get_job(tenant_id, record.job_id)
    states = ERROR_STATES if file_id == job.error_file_id else OUTPUT_STATES
    return iter_result_lines(repo, job.id, states)


def _stored_lines(repo: BatchStore, tenant_id: str, file_id: str) -> Iterator[bytes]:
    """An input file's lines, read from storage a piece at a time."""
    return iter_lines(repo.file_pieces(tenant_id, file_id) or ())


def _located_lines(repo: BatchStore, tenant_id: str, file_id: str) -> InputLines:
    """An input file's lines with where each lies in its stored pieces (so an item can point
    at its line instead of copying its body), or just its lines for a file stored whole."""
    chunks = repo.file_chunks(tenant_id, file_id)
    if chunks is None:
        return _stored_lines(repo, tenant_id, file_id)
    return LocatedLines(iter_located_lines(read_ahead(chunks)))


def _same_request(job: JobRecord, request: BatchRequest) -> bool:
    return (
        job.input_file_id == request.input_file_id
        and job.endpoint == request.endpoint
        and job.completion_window == request.completion_window
    )


def _retried(repo: BatchStore, tenant_id: str, job_id: str, request: BatchRequest) -> JobRecord:
    job = repo.get_job(tenant_id, job_id)
    if not _same_request(job, request):
        raise IdempotencyMismatch(
            f"Idempotency-Key {request.idempotency_key!r} was used for batch {job.id} with "
            "different parameters",
            param="Idempotency-Key",
        )
    return job


def create_batch(
    repo: BatchStore,
    settings: Settings,
    tenant: TenantRecord,
    request: BatchRequest,
    *,
    now: datetime | None = None,
    measured_tps: float | None = None,
) -> JobRecord:
    """Check and store a batch; returns it ``in_progress`` (or ``failed`` for bad input)."""
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
    if request.idempotency_key is not None:
        first = repo.job_id_for_idempotency_key(tenant.id, request.idempotency_key)
        if first is not None:
            return _retried(repo, tenant.id, first, request)

    try:
        record = repo.get_file(tenant.id, request.input_file_id)
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
    active = repo.count_active_jobs(tenant.id)
    if active >= settings.max_active_batches_per_tenant:
        raise LimitReached(
            f"{active} batches are active; the limit is {settings.max_active_batches_per_tenant}"
            " per tenant. Wait for one to finish or cancel one."
        )

    # The file is read from storage a piece at a time by each pass over it, never whole.
    def content() -> Iterator[bytes]:
        return _stored_lines(repo, tenant.id, record.id)

    limits = InputLimits.from_settings(settings)
    # Quota and deadline are judged before anything is stored, on an upper bound of the
    # file's forecast tokens (the upload's scan recorded it; a file uploaded before is
    # scanned now), so a refusal is a clean 4xx with no job.
    forecast = record.tokens_bound
    if forecast is None:
        forecast = forecast_tokens_upper_bound(content())
    # Postgres' clock: the deadline is stored there and judged there (this host's may be off).
    now = now or repo.now()
    tps = batch_throughput(settings.batch_throughput_tokens_per_s, measured_tps)
    plan = _judge_tokens(
        repo, settings, tenant, forecast, now, window_s, tps, request.completion_window
    )

    model = first_model(content())
    _check_model_served(repo, settings, model, request.endpoint)
    job = repo.create_job(
        tenant.id,
        record.id,
        request.endpoint,
        request.completion_window,
        now + timedelta(seconds=window_s),
        metadata=metadata,
        idempotency_key=request.idempotency_key,
        model=model,
        output_expires_after_s=output_expires_after_s,
    )
    if request.idempotency_key is not None and (
        job.state is not JobState.VALIDATING or not _same_request(job, request)
    ):
        # A concurrent create with the same key won the insert: answer with its job.
        return _retried(repo, tenant.id, job.id, request)

    tally = Tally()

    def items() -> Iterator[NewItem]:
        lines = _located_lines(repo, tenant.id, record.id)
        yield from stream_valid_items(lines, request.endpoint, limits, tally)
        # The bound counts each line's output budget once: a line of several prompts (one
        # sequence each) or a file with escaped JSON keys needs more. Judge the exact figure
        # before the items commit.
        exact = tally.max_output_tokens + tally.estimated_prompt_tokens
        if exact > forecast:
            try:
                _judge_tokens(
                    repo, settings, tenant, exact, now, window_s, tps, request.completion_window
                )
            except Refusal as refusal:
                raise ForecastExceeded(refusal) from refusal

    estimated = plan.estimated_completion.isoformat(timespec="seconds")
    try:
        # Parsing feeds the COPY line by line, so Postgres stores while Python parses; the
        # first bad line aborts the COPY and nothing of the file is stored. The job moves to
        # in_progress in the COPY's transaction: its items are claimable exactly from then.
        repo.insert_items(
            job.id,
            items(),
            start_reason=lambda n: f"{n} requests accepted; estimated completion {estimated}",
        )
    except StaleWrite:
        # Cancelled (or expired, or recovered) while the items streamed in: none was stored.
        return repo.get_job(tenant.id, job.id)
    except LineInvalid:
        checked = validate_batch_input(content(), request.endpoint, limits)
        errors = checked.errors if isinstance(checked, InvalidBatch) else []
        _fail(repo, job.id, [e.as_dict() for e in errors], f"{len(errors)} invalid lines")
        return repo.get_job(tenant.id, job.id)
    except ForecastExceeded as exc:
        refusal = exc.args[0]
        _fail(repo, job.id, [_entry(refusal.code, refusal.message)], refusal.message)
        return repo.get_job(tenant.id, job.id)
    except Conflict:
        # A concurrent create with the same Idempotency-Key stored the items first.
        return _retried(repo, tenant.id, job.id, request)
    except BaseException:
        _fail_quietly(repo, job.id)
        raise
    return repo.get_job(tenant.id, job.id)


class ForecastExceeded(Exception):
    """The exact forecast of a file, above the bound it was admitted on, breaks the quota or
    the deadline (``args[0]``: the :class:`Refusal`)."""


def _judge_tokens(
    repo: BatchStore,
    settings: Settings,
    tenant: TenantRecord,
    tokens: int,
    now: datetime,
    window_s: int,
    throughput_tps: float,
    completion_window: str,
) -> DeadlinePlan:
    """Refuse a batch of ``tokens`` forecast tokens that breaks the tenant's quota or cannot
    finish within its window; else the plan of its completion."""
    if tenant.enqueued_token_quota is not None:
        enqueued = repo.enqueued_tokens(tenant.id)
        if enqueued + tokens > tenant.enqueued_token_quota:
            raise QuotaExceeded(
                f"this batch needs up to {tokens} tokens; {enqueued} of the tenant's quota "
                f"of {tenant.enqueued_token_quota} enqueued tokens are in use"
            )
    if settings.fair_share:
        # Its tenant's backlog at its share, with the other tenants' work done meanwhile.
        ahead = (
            tokens_until_done(repo.backlog_by_tenant(), tenant.id, tenant.weight, tokens) - tokens
        )
    else:
        ahead = repo.backlog_tokens()
    plan = plan_deadline(
        now,
        window_s,
        backlog_tokens=ahead,
        batch_tokens=tokens,
        throughput_tps=throughput_tps,
    )
    if not plan.feasible:
        needed_s = max(60, round((plan.estimated_completion - now).total_seconds()))
        raise DeadlineInfeasible(
            f"completion_window {completion_window!r} cannot be met: with the current "
            f"backlog this batch would finish in about {format_window(needed_s)}; the "
            f"earliest feasible completion_window is {plan.earliest_window!r}",
            earliest_window=plan.earliest_window,
            estimated_completion=int(plan.estimated_completion.timestamp()),
        )
    return plan


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
    served, any_live = repo.served_models(settings.node_live_s)
    if not any_live:
        return
    if model not in served:
        raise ModelNotFound(
            f"The model `{model}` is not served by any node; served: "
            + ", ".join(f"`{m}`" for m in sorted(served)),
            param="model",
        )
    endpoints = repo.served_endpoints(model, settings.node_live_s)
    if endpoints is not None and endpoint not in endpoints:
        raise ModelNotFound(
            f"The model `{model}` is not served for {endpoint}; it is served for: "
            + (", ".join(sorted(endpoints)) or "no batch endpoint"),
            param="model",
        )


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


def _entry(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": None}


def _fail(repo: BatchStore, job_id: str, errors: list[dict[str, Any]], reason: str) -> None:
    with contextlib.suppress(StaleWrite):
        repo.move_job(job_id, JobState.FAILED, reason=reason, errors=errors)


def _fail_quietly(repo: BatchStore, job_id: str) -> None:
    """Mark a job whose items could not be stored; if even that fails, the periodic
    ``recover_stale_validating`` will."""
    # Best effort on an already failing path (Postgres may be the reason it fails).
    with contextlib.suppress(Exception):
        repo.move_job(
            job_id,
            JobState.FAILED,
            reason="storing the items failed",
            errors=[
                {
                    "code": "storage_failed",
                    "message": "the requests could not be stored; create the batch again",
                    "param": None,
                    "line": None,
                }
            ],
        )
