"""The ends of a job: finalize, cancel, expire. Plain functions over the store's job lifecycle
(:class:`~backfill.store.JobLifecycle`).

Each function is safe to call again and from several processes at once (Celery beat may run
it on two workers): every state change is a guarded transition, and a caller that loses a
race sees ``StaleWrite`` internally and steps back, leaving the job to the winner.

A job whose items all ended reads as OpenAI's would: ``completed`` when its requests ran
(whatever share of them failed: ``request_counts`` and the error file say which and why),
``expired`` when its deadline passed first or none of it could finish in time; ``failed`` is
only for a batch that could not start.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from backfill.errors import NotFound, StaleWrite
from backfill.refusals import NotCancellable
from backfill.results import ERROR_STATES, OUTPUT_STATES, rendered_size
from backfill.states import ItemState, JobState
from backfill.store import ActiveLeaseRow, JobLifecycle, JobRecord

OUTPUT_PURPOSE = "batch_output"


def _error(code: str, message: str) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": None}


def write_result_files(repo: JobLifecycle, job: JobRecord) -> tuple[str | None, str | None]:
    """File rows for the job's output and error files (None where there is nothing to put in
    one); their content is rendered from the items when read."""
    ids: list[str | None] = []
    for kind, states in (("output", OUTPUT_STATES), ("error", ERROR_STATES)):
        lines, size = rendered_size(repo, job.id, states)
        if not lines:
            ids.append(None)
            continue
        record = repo.files.create_file(
            job.tenant_id,
            OUTPUT_PURPOSE,
            f"{job.id}_{kind}.jsonl",
            None,
            size_bytes=size,
            job_id=job.id,
        )
        ids.append(record.id)
    return ids[0], ids[1]


def _drop_files(repo: JobLifecycle, tenant_id: str, *file_ids: str | None) -> None:
    for file_id in file_ids:
        if file_id is not None:
            with contextlib.suppress(NotFound):
                repo.files.delete_file(tenant_id, file_id)


def _end_with_files(
    repo: JobLifecycle,
    job: JobRecord,
    target: JobState,
    *,
    reason: str,
    errors: list[dict[str, Any]] | None = None,
) -> bool:
    """Write the result files and move the job to ``target``; False if another caller won."""
    output_id, error_id = write_result_files(repo, job)
    try:
        repo.jobs.move_job(
            job.id,
            target,
            reason=reason,
            errors=errors,
            output_file_id=output_id,
            error_file_id=error_id,
        )
    except StaleWrite:
        _drop_files(repo, job.tenant_id, output_id, error_id)
        return False
    return True


def finished_state(job: JobRecord) -> tuple[JobState, str]:
    """The state a job whose items have all ended goes to, and why (OpenAI's meanings).

    ``completed`` whenever its requests ran, even if every one failed (``request_counts``
    says how many; the error file says why for each); ``expired`` only when none ran because
    none could finish by the deadline. ``failed`` is for a batch that could not start
    (validation), never decided here."""
    counts = job.counts
    succeeded = counts.count(ItemState.SUCCEEDED)
    failed = counts.count(ItemState.FAILED)
    expired = counts.count(ItemState.EXPIRED)
    if expired and not (succeeded or failed):
        return JobState.EXPIRED, (
            f"none of {counts.total} requests could finish by the deadline, so none was started"
        )
    parts = [f"{succeeded} of {counts.total} requests succeeded"]
    if failed:
        parts.append(f"{failed} failed")
    if expired:
        parts.append(f"{expired} were not started: they could not finish by the deadline")
    return JobState.COMPLETED, "; ".join(parts)


def finalize_job(repo: JobLifecycle, job_id: str) -> JobState | None:
    """Close a job whose items are all finished: finalizing, then the state
    :func:`finished_state` gives. Returns the state it ended in, or None if it was not ready
    or another caller took it."""
    job = repo.jobs.get_job(None, job_id)
    if job.state not in (JobState.IN_PROGRESS, JobState.FINALIZING) or job.counts.unfinished:
        return None
    if job.state is JobState.IN_PROGRESS:
        try:
            repo.jobs.move_job(job_id, JobState.FINALIZING, reason="every item finished")
        except StaleWrite:
            return None
        job = repo.jobs.get_job(None, job_id)
    target, reason = finished_state(job)
    if _end_with_files(repo, job, target, reason=reason):
        return target
    return None


def finalize_ready_jobs(repo: JobLifecycle, limit: int = 100) -> dict[str, JobState]:
    """Finalize every job whose items are all finished (the periodic task's body)."""
    done: dict[str, JobState] = {}
    for job_id in repo.jobs.jobs_with_all_items_finished(limit):
        state = finalize_job(repo, job_id)
        if state is not None:
            done[job_id] = state
    return done


def settle_cancelling(repo: JobLifecycle, job_id: str) -> JobState:
    """Move a cancelling job on: cancel items that became claimable again (preempted or
    requeued since the cancel), and close the job once no attempt holds an item."""
    job = repo.jobs.get_job(None, job_id)
    if job.state is not JobState.CANCELLING:
        return job.state
    repo.items.end_items(job_id, ItemState.CANCELLED, only_unstarted=True)
    job = repo.jobs.get_job(None, job_id)
    in_flight = job.counts.count(ItemState.RESERVED) + job.counts.count(ItemState.RUNNING)
    if in_flight:
        return JobState.CANCELLING
    reason = f"cancelled; {job.counts.count(ItemState.SUCCEEDED)} results kept"
    if _end_with_files(repo, job, JobState.CANCELLED, reason=reason):
        return JobState.CANCELLED
    return repo.jobs.get_job(None, job_id).state


def cancel_job(repo: JobLifecycle, tenant_id: str, job_id: str) -> JobRecord:
    """Cancel a tenant's job: unstarted items end at once; in-flight ones finish or are
    aborted by their workers, after which the job is cancelled. Finished results are kept."""
    job = repo.jobs.get_job(tenant_id, job_id)
    if job.state in (JobState.VALIDATING, JobState.IN_PROGRESS):
        try:
            repo.jobs.move_job(job_id, JobState.CANCELLING, reason="cancel requested")
        except StaleWrite:
            job = repo.jobs.get_job(tenant_id, job_id)
    elif job.state not in (JobState.CANCELLING, JobState.CANCELLED):
        raise NotCancellable(f"cannot cancel a batch that is {job.state.value}")
    settle_cancelling(repo, job_id)
    job = repo.jobs.get_job(tenant_id, job_id)
    if job.state not in (JobState.CANCELLING, JobState.CANCELLED):
        raise NotCancellable(f"cannot cancel a batch that is {job.state.value}")
    return job


def settle_cancelling_jobs(repo: JobLifecycle, limit: int = 100) -> dict[str, JobState]:
    return {
        job_id: settle_cancelling(repo, job_id)
        for job_id in repo.jobs.jobs_in_state(JobState.CANCELLING, limit)
    }


def expire_job(repo: JobLifecycle, job_id: str) -> list[ActiveLeaseRow]:
    """At the deadline: unfinished items expire, finished results stay downloadable.

    Returns the items that were in flight, so the caller can release their leases and abort
    their engine requests."""
    job = repo.jobs.get_job(None, job_id)
    if job.state is JobState.VALIDATING:
        with contextlib.suppress(StaleWrite):
            repo.jobs.move_job(
                job_id,
                JobState.FAILED,
                reason="deadline passed during validation",
                errors=[_error("batch_expired", "the deadline passed before validation ended")],
            )
        return []
    if job.state is not JobState.IN_PROGRESS:
        return []
    in_flight = repo.items.end_items(job_id, ItemState.EXPIRED)
    job = repo.jobs.get_job(None, job_id)
    reason = f"deadline passed; {job.counts.count(ItemState.SUCCEEDED)} results kept"
    _end_with_files(repo, job, JobState.EXPIRED, reason=reason)
    return in_flight


@dataclass(slots=True)
class ExpirySweep:
    expired_jobs: list[str] = field(default_factory=list)
    in_flight: list[ActiveLeaseRow] = field(default_factory=list)


def expire_due_jobs(repo: JobLifecycle, limit: int = 100) -> ExpirySweep:
    """Expire every job past its deadline (the periodic task's body)."""
    sweep = ExpirySweep()
    for job_id in repo.jobs.jobs_past_deadline(limit):
        sweep.in_flight.extend(expire_job(repo, job_id))
        sweep.expired_jobs.append(job_id)
    return sweep


def recover_stale_validating(
    repo: JobLifecycle, *, older_than_s: float, now: datetime | None = None
) -> dict[str, JobState]:
    """Jobs left in ``validating`` by an API process that died mid-create (run by the
    maintenance tick): those whose items were all stored go on to in_progress, the rest fail
    with a message to resubmit. A create still at work is left alone, however slow."""
    # Judged on Postgres' clock, which stamped ``created_at`` (this host's may be off).
    cutoff = (now or repo.now()) - timedelta(seconds=older_than_s)
    errors = [
        _error("validation_interrupted", "validation was interrupted; create the batch again")
    ]
    return repo.jobs.recover_validating(cutoff, errors)
