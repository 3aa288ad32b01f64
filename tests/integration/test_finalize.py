"""Finalize, cancel, expire and recovery: plain functions a periodic task calls."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime, timedelta

import pytest
from batch_api_support import chat_file, make_tenant, run_worker
from sqlalchemy import text

from backfill import batches
from backfill.config import Settings
from backfill.errors import NotFound
from backfill.finalize import (
    cancel_job,
    expire_due_jobs,
    finalize_job,
    finalize_ready_jobs,
    recover_stale_validating,
    settle_cancelling_jobs,
)
from backfill.results import ERROR_STATES, iter_result_lines
from backfill.states import ItemState, JobState
from backfill.store import JobRecord, NewItem, Repository
from tests.integration.claiming import claim


def submit(repo: Repository, settings: Settings, lines: int, window: str = "24h") -> JobRecord:
    record = repo.tenants.create_tenant(f"acme-{secrets.token_hex(3)}")
    upload = batches.upload_file(
        repo, settings, record.id, filename="in.jsonl", purpose="batch", content=chat_file(lines)
    )
    request = batches.BatchRequest(upload.id, "/v1/chat/completions", window)
    return batches.create_batch(repo, settings, record, request)


def test_a_job_with_unfinished_items_is_not_finalized(repo: Repository, settings: Settings) -> None:
    job = submit(repo, settings, 3)
    run_worker(repo, limit=2)
    assert finalize_job(repo, job.id) is None
    assert finalize_ready_jobs(repo) == {}
    assert repo.jobs.get_job(None, job.id).state is JobState.IN_PROGRESS


def test_finalize_is_safe_to_run_twice(repo: Repository, settings: Settings) -> None:
    job = submit(repo, settings, 2)
    run_worker(repo)
    assert finalize_ready_jobs(repo) == {job.id: JobState.COMPLETED}
    assert finalize_ready_jobs(repo) == {}
    assert finalize_job(repo, job.id) is None
    events = [to for _, to, _ in repo.jobs.job_events(job.id)]
    assert events == ["validating", "in_progress", "finalizing", "completed"]


def test_a_job_left_in_finalizing_by_a_crash_is_finished_by_the_next_sweep(
    repo: Repository, settings: Settings
) -> None:
    job = submit(repo, settings, 1)
    run_worker(repo)
    repo.jobs.move_job(job.id, JobState.FINALIZING)
    assert finalize_ready_jobs(repo) == {job.id: JobState.COMPLETED}
    assert repo.jobs.get_job(None, job.id).output_file_id is not None


def test_expiry_keeps_finished_results_and_expires_the_rest(
    repo: Repository, settings: Settings
) -> None:
    job = submit(repo, settings, 4, window="5m")
    in_flight = run_worker(repo, limit=2, leave_running=1)  # req-0 done, req-1 running
    # Let the deadline pass: a job's deadline is its items' deadline too.
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET deadline = now() - interval '1 second' WHERE id = :i"),
            {"i": job.id},
        )
    sweep = expire_due_jobs(repo)
    assert sweep.expired_jobs == [job.id]
    # The running item is handed back so its lease can be released and its request aborted.
    assert [row.item_id for row in sweep.in_flight] == [in_flight["req-1"][0]]

    expired = repo.jobs.get_job(None, job.id)
    assert expired.state is JobState.EXPIRED
    assert expired.counts.count(ItemState.SUCCEEDED) == 1
    assert expired.counts.count(ItemState.EXPIRED) == 3
    assert expired.output_file_id is not None
    assert expired.error_file_id is not None
    lines = list(iter_result_lines(repo, job.id, ERROR_STATES))
    assert len(lines) == 3
    assert all('"batch_expired"' in line for line in lines)
    assert expire_due_jobs(repo).expired_jobs == []


def test_a_preempted_item_of_a_cancelling_job_is_cancelled_by_the_next_settle(
    repo: Repository, settings: Settings
) -> None:
    job = submit(repo, settings, 2)
    running = run_worker(repo, limit=1, leave_running=1)
    item_id, attempt, fence = running["req-0"]
    assert cancel_job(repo, job.tenant_id, job.id).state is JobState.CANCELLING
    repo.items.preempt(item_id, attempt, fence, partial_output="par", partial_tokens=2)
    assert settle_cancelling_jobs(repo) == {job.id: JobState.CANCELLED}
    cancelled = repo.jobs.get_job(None, job.id)
    assert cancelled.counts.count(ItemState.CANCELLED) == 2


def test_cancel_of_another_tenants_job_is_not_found(repo: Repository, settings: Settings) -> None:
    job = submit(repo, settings, 1)
    other = repo.tenants.create_tenant("other")
    with pytest.raises(NotFound):
        cancel_job(repo, other.id, job.id)


def test_a_create_interrupted_in_validating_is_recovered(
    repo: Repository, settings: Settings
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    stored = repo.jobs.create_job(
        tenant.id, "file-x", "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    empty = repo.jobs.create_job(
        tenant.id, "file-y", "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(stored.id, [NewItem(1, "a", "{}", 5)])
    assert recover_stale_validating(repo, older_than_s=60) == {}
    later = datetime.now(UTC) + timedelta(minutes=5)
    moved = recover_stale_validating(repo, older_than_s=60, now=later)
    assert moved == {stored.id: JobState.IN_PROGRESS, empty.id: JobState.FAILED}
    failed = repo.jobs.get_job(None, empty.id)
    assert failed.errors is not None
    assert failed.errors[0]["code"] == "validation_interrupted"


def test_cli_style_tenant_helper_makes_working_keys(repo: Repository) -> None:
    tenant = make_tenant(repo, "keys")
    found = repo.tenants.tenant_for_key(tenant.key)
    assert found is not None
    assert found.id == tenant.id


def test_a_job_whose_items_the_worker_expired_before_the_deadline_ends_expired(
    repo: Repository, settings: Settings
) -> None:
    # The worker expires what cannot finish by the deadline instead of starting it; once
    # every item has ended so, the job is expired (not "failed": nothing went wrong but time).
    job = submit(repo, settings, 3)
    claimed = claim(repo, "n-expire", 10)
    assert {c.job_id for c in claimed} == {job.id}
    for item in claimed:
        repo.items.expire_claimed(item.id, item.attempt, "needs 40 s; 5 s left before the deadline")
    assert finalize_ready_jobs(repo) == {job.id: JobState.EXPIRED}
    ended = repo.jobs.get_job(None, job.id)
    assert ended.counts.count(ItemState.EXPIRED) == 3
    assert ended.output_file_id is None
    assert ended.error_file_id is not None
    lines = list(iter_result_lines(repo, job.id, ERROR_STATES))
    assert len(lines) == 3
    assert all("5 s left before the deadline" in line for line in lines)


def test_a_job_that_ran_and_expired_the_rest_early_completes_in_its_window(
    repo: Repository, settings: Settings
) -> None:
    # The worker expired two requests instead of starting them (they could not finish by the
    # deadline) and ran the third. All ended before the deadline: completed, as at OpenAI,
    # with the two counted failed and written to the error file.
    job = submit(repo, settings, 3)
    claimed = claim(repo, "n-mixed", 2)
    assert len(claimed) == 2
    for item in claimed:
        repo.items.expire_claimed(item.id, item.attempt, "needs 40 s; 5 s left before the deadline")
    run_worker(repo)
    assert finalize_ready_jobs(repo) == {job.id: JobState.COMPLETED}
    ended = repo.jobs.get_job(None, job.id)
    assert ended.counts.count(ItemState.SUCCEEDED) == 1
    assert ended.counts.count(ItemState.EXPIRED) == 2
    assert ended.output_file_id is not None
    assert ended.error_file_id is not None
    assert not ended.errors
