"""A created batch's file checked line by line and its items stored: in the create's request for a
small file, or later by an ingest process (``backfill.ingester``) for a large one. No HTTP here.

Either way the same steps: every line parsed and checked once, its row spooled, and only a file
whose every line passed streams into one COPY, whose transaction also moves the job to
``in_progress``. A bad line anywhere (the last one too) fails the job before any row reaches
Postgres (no row formed, none to vacuum): the job ends ``failed`` with ``errors`` naming each bad
line, as OpenAI's Batch API does. A cancel during validation takes effect at once; the ingest then
stores nothing (see ``Ingest.insert_items``). The quota and the deadline were judged at the
create on an upper bound of the file's tokens; an ingest judges them again on the exact figure where
that is higher, and a deferred one first judges them again as they stand when it starts (other
batches may have been stored, and time has passed, since the create).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from backfill.batch_input import (
    InputLimits,
    InputLines,
    LineInvalid,
    LocatedLines,
    Tally,
    forecast_tokens_upper_bound,
    stream_valid_items,
)
from backfill.config import Settings
from backfill.errors import Conflict, NotFound, StaleWrite
from backfill.fairshare import tokens_until_done
from backfill.refusals import DeadlineInfeasible, QuotaExceeded, Refusal, StorageCapReached
from backfill.states import JobState
from backfill.store import BatchStore, JobRecord, NewItem, TenantRecord
from backfill.upload_scan import iter_lines, iter_located_lines, read_ahead
from backfill.windows import DeadlinePlan, batch_throughput, format_window, plan_deadline
from backfill.work_bell import work_bell

MAX_INGEST_ATTEMPTS = 3
"""Deferred ingests of one batch begun before it fails: a file that takes an ingest process
down each time (memory, a crash) ends its batch instead of looping."""


@dataclass(frozen=True, slots=True)
class Admission:
    """What a batch was admitted on: its file's bound of forecast tokens, the time its
    deadline is judged from and the window left then, and the throughput assumed."""

    forecast: int
    now: datetime
    window_s: int
    throughput_tps: float
    completion_window: str


class Overlap(Protocol):
    """How a deferred ingest shares its ingest process with the ingest taken just before it:
    it reads its file while the earlier one's COPY runs, and judges what reads the store
    (the tenant's stored items and quota, the deadline) only once that one has ended."""

    def file_read(self) -> None:
        """Every line of this ingest's file is checked (or it ended early): the next ingest
        may begin reading its own."""

    def wait_for_earlier(self, tenant_id: str) -> None:
        """Return once the ingest taken before this one has committed its items or ended,
        and no other ingest of this process judges or stores one of ``tenant_id``'s (the
        turn is held until this ingest ends)."""


class ForecastExceeded(Exception):
    """The exact figures of a file, above the bounds it was admitted on, break the quota, the
    deadline or the tenant's storage cap (``args[0]``: the :class:`Refusal`)."""


def stored_lines(repo: BatchStore, tenant_id: str, file_id: str) -> Iterator[bytes]:
    """An input file's lines, read from storage a piece at a time."""
    return iter_lines(repo.files.file_pieces(tenant_id, file_id) or ())


def located_lines(repo: BatchStore, tenant_id: str, file_id: str) -> InputLines:
    """An input file's lines with where each lies in its stored pieces (so an item can point
    at its line instead of copying its body), or just its lines for a file stored whole."""
    chunks = repo.files.file_chunks(tenant_id, file_id)
    if chunks is None:
        return stored_lines(repo, tenant_id, file_id)
    return LocatedLines(iter_located_lines(read_ahead(chunks)))


def judge_tokens(
    repo: BatchStore,
    settings: Settings,
    tenant: TenantRecord,
    tokens: int,
    admission: Admission,
) -> DeadlinePlan:
    """Refuse a batch of ``tokens`` forecast tokens that breaks the tenant's quota or cannot
    finish within its window; else the plan of its completion."""
    if tenant.enqueued_token_quota is not None:
        enqueued = repo.jobs.enqueued_tokens(tenant.id)
        if enqueued + tokens > tenant.enqueued_token_quota:
            raise QuotaExceeded(
                f"this batch needs up to {tokens} tokens; {enqueued} of the tenant's quota "
                f"of {tenant.enqueued_token_quota} enqueued tokens are in use"
            )
    if settings.fair_share:
        # Its tenant's backlog at its share, with the other tenants' work done meanwhile.
        ahead = (
            tokens_until_done(repo.stats.backlog_by_tenant(), tenant.id, tenant.weight, tokens)
            - tokens
        )
    else:
        ahead = repo.stats.backlog_tokens()
    plan = plan_deadline(
        admission.now,
        admission.window_s,
        backlog_tokens=ahead,
        batch_tokens=tokens,
        throughput_tps=admission.throughput_tps,
    )
    if not plan.feasible:
        now = admission.now
        needed_s = max(60, round((plan.estimated_completion - now).total_seconds()))
        raise DeadlineInfeasible(
            f"completion_window {admission.completion_window!r} cannot be met: with the "
            f"current backlog this batch would finish in about {format_window(needed_s)}; the "
            f"earliest feasible completion_window is {plan.earliest_window!r}",
            earliest_window=plan.earliest_window,
            estimated_completion=int(plan.estimated_completion.timestamp()),
        )
    return plan


def ingest_items(
    repo: BatchStore,
    settings: Settings,
    tenant: TenantRecord,
    job: JobRecord,
    admission: Admission,
    plan: DeadlinePlan,
    *,
    fail_on_error: bool = True,
    overlap: Overlap | None = None,
) -> JobRecord:
    """Check a validating job's file line by line and store its items (the job then runs),
    or fail the job naming every bad line, or the quota or deadline its exact forecast
    breaks. Returns the job as it is after. ``Conflict`` (a concurrent create with the same
    ``Idempotency-Key`` stored the items first) is left to the caller. Any other error
    fails the job too, unless ``fail_on_error`` is False (a deferred ingest: the job stays
    validating for the next ingest, up to :data:`MAX_INGEST_ATTEMPTS`). With ``overlap`` the
    file is read while the ingest before it may still be storing; the tenant's stored items,
    its quota and the deadline are then judged once that one has ended, on the exact figure."""
    limits = InputLimits.from_settings(settings, (tenant.id, tenant.name))
    tally = Tally()

    def items() -> Iterator[NewItem]:
        lines = located_lines(repo, tenant.id, job.input_file_id)
        yield from stream_valid_items(lines, job.endpoint, limits, tally)
        if overlap is not None:
            overlap.file_read()
            # What the earlier ingest stores counts against this one's cap and quota.
            overlap.wait_for_earlier(tenant.id)
        stored = repo.tenants.stored_items(tenant.id)
        cap = settings.max_stored_items_per_tenant
        if stored + tally.lines > cap:
            raise ForecastExceeded(
                StorageCapReached(
                    f"this batch has {tally.lines} requests; the tenant stores {stored} batch "
                    f"items and may store {cap} (BACKFILL_MAX_STORED_ITEMS_PER_TENANT; "
                    "finished batches count until they are purged)"
                )
            )
        # The bound counts each line's output budget once: a line of several prompts (one
        # sequence each) or a file with escaped JSON keys needs more. Judge the exact figure
        # before the items commit.
        # Judged again on the bound too when an earlier ingest may have stored meanwhile.
        exact = tally.max_output_tokens + tally.estimated_prompt_tokens
        if exact > admission.forecast or overlap is not None:
            try:
                judge_tokens(repo, settings, tenant, max(exact, admission.forecast), admission)
            except Refusal as refusal:
                raise ForecastExceeded(refusal) from refusal

    estimated = plan.estimated_completion.isoformat(timespec="seconds")
    try:
        # Every line is parsed and checked (and the exact figures judged) before the first row
        # goes to Postgres: a refused file costs it nothing. The job moves to in_progress in
        # the COPY's transaction: its items are claimable exactly from then.
        repo.ingest.insert_items(
            job.id,
            items(),
            start_reason=lambda n: f"{n} requests accepted; estimated completion {estimated}",
        )
    except StaleWrite:
        # Cancelled (or expired, or recovered) while the items streamed in: none was stored.
        pass
    except LineInvalid as invalid:
        errors = [e.as_dict() for e in invalid.errors]
        fail_job(repo, job.id, errors, f"{len(errors)} invalid lines")
    except ForecastExceeded as exc:
        refusal = exc.args[0]
        fail_job(repo, job.id, [error_entry(refusal.code, refusal.message)], refusal.message)
    except Conflict:
        raise
    except BaseException:
        if fail_on_error:
            _fail_quietly(repo, job.id)
        raise
    else:
        # Its items are claimable: the idle dispatchers of its model claim now, not a poll on.
        work_bell(settings.redis_url, settings.redis_namespace).ring(job.model)
    return repo.jobs.get_job(tenant.id, job.id)


def ingest_deferred(
    repo: BatchStore,
    settings: Settings,
    job_id: str,
    attempt: int,
    *,
    overlap: Overlap | None = None,
) -> JobRecord | None:
    """An ingest process's work on one deferred create (``attempt`` counts from 1): judge
    the quota and the deadline again as they stand now, then check and store its file
    (``overlap``: see :func:`ingest_items`). Returns the job as it is after, or None if it
    is gone (purged, its tenant deleted)."""
    try:
        job = repo.jobs.get_job(None, job_id)
        tenant = repo.tenants.tenant_by_id(job.tenant_id)
    except NotFound:
        return None
    if job.state is not JobState.VALIDATING:
        return job  # cancelled or expired while it waited: nothing to store
    if attempt > MAX_INGEST_ATTEMPTS:
        fail_job(
            repo,
            job.id,
            [
                error_entry(
                    "validation_interrupted",
                    f"validation was interrupted {attempt - 1} times (the ingest process "
                    "stopped while it read this file); create the batch again",
                )
            ],
            "validation interrupted repeatedly",
        )
        return repo.jobs.get_job(None, job.id)
    try:
        record = repo.files.get_file(job.tenant_id, job.input_file_id)
    except NotFound:
        message = f"No such File object: {job.input_file_id} (deleted before it was validated)"
        fail_job(repo, job.id, [error_entry("invalid_input_file", message)], message)
        return repo.jobs.get_job(None, job.id)
    forecast = record.tokens_bound
    if forecast is None:
        forecast = forecast_tokens_upper_bound(stored_lines(repo, job.tenant_id, record.id))
    now = repo.now()
    admission = Admission(
        forecast=forecast,
        now=now,
        window_s=max(0, int((job.deadline - now).total_seconds())),
        throughput_tps=batch_throughput(settings.batch_throughput_tokens_per_s),
        completion_window=job.completion_window,
    )
    try:
        plan = judge_tokens(repo, settings, tenant, forecast, admission)
    except Refusal as refusal:
        fail_job(repo, job.id, [error_entry(refusal.code, refusal.message)], refusal.message)
        return repo.jobs.get_job(None, job.id)
    try:
        return ingest_items(
            repo, settings, tenant, job, admission, plan, fail_on_error=False, overlap=overlap
        )
    except Conflict:
        return repo.jobs.get_job(None, job.id)


def error_entry(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": None}


def fail_job(repo: BatchStore, job_id: str, errors: list[dict[str, Any]], reason: str) -> None:
    with contextlib.suppress(StaleWrite):
        repo.jobs.move_job(job_id, JobState.FAILED, reason=reason, errors=errors)


def _fail_quietly(repo: BatchStore, job_id: str) -> None:
    """Mark a job whose items could not be stored; if even that fails, the periodic
    ``recover_stale_validating`` (or, for a deferred create, the next ingest) will."""
    # Best effort on an already failing path (Postgres may be the reason it fails).
    with contextlib.suppress(Exception):
        repo.jobs.move_job(
            job_id,
            JobState.FAILED,
            reason="storing the items failed",
            errors=[
                error_entry(
                    "storage_failed", "the requests could not be stored; create the batch again"
                )
            ],
        )
