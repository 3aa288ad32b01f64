"""Retention: a batch that ended longer ago than ``retention_s`` is purged by the maintenance
tick with its items, attempts, webhook events and deliveries, and result files, a bounded
number of rows per tick; batches that ended since, or have not ended, and input files stay."""

from __future__ import annotations

from batch_api_support import chat_file, make_tenant, run_worker
from sqlalchemy import text

from backfill import batches
from backfill.config import Settings
from backfill.finalize import finalize_ready_jobs
from backfill.ledger import Ledger
from backfill.maintenance import tick
from backfill.states import JobState
from backfill.store import Repository
from backfill.webhooks.endpoints import add_endpoint
from backfill.webhooks.store import WebhookStore
from tests.integration.support_sql import count_rows, kept_30_days


def _still() -> float:
    """A clock that stands still: only the rows bound a tick here."""
    return 0.0


def test_a_batch_past_its_retention_is_purged_in_bounded_ticks_and_nothing_else_is(
    settings: Settings, repo: Repository, tick_ledger: Ledger
) -> None:
    s = kept_30_days(
        settings, retention_chunk_rows=4, retention_rows_per_tick=10, webhooks_allow_private=True
    )
    tenant = make_tenant(repo, "acme")
    record = repo.tenants.tenant_for_key(tenant.key)
    assert record is not None
    add_endpoint(WebhookStore(repo.engine), s, tenant.id, url="http://127.0.0.1:9/hook")

    def finished_job(lines: int) -> str:
        upload = batches.upload_file(
            repo, s, tenant.id, filename="in.jsonl", purpose="batch", content=chat_file(lines)
        )
        request = batches.BatchRequest(upload.id, "/v1/chat/completions", "24h")
        job = batches.create_batch(repo, s, record, request)
        run_worker(repo)
        assert finalize_ready_jobs(repo) == {job.id: JobState.COMPLETED}
        return job.id

    old, recent = finished_job(25), finished_job(3)
    upload = batches.upload_file(
        repo, s, tenant.id, filename="open.jsonl", purpose="batch", content=chat_file(2)
    )
    running = batches.create_batch(
        repo, s, record, batches.BatchRequest(upload.id, "/v1/chat/completions", "24h")
    ).id
    with repo.engine.begin() as conn:
        # The old batch ended 31 days ago; the open one was created then.
        conn.execute(
            text(
                "UPDATE jobs SET completed_at = now() - interval '31 days', "
                "created_at = now() - interval '31 days' WHERE id = :o"
            ),
            {"o": old},
        )
        conn.execute(
            text("UPDATE jobs SET created_at = now() - interval '31 days' WHERE id = :r"),
            {"r": running},
        )
    [old_job] = [j for j in repo.jobs.list_jobs(tenant.id) if j.id == old]
    assert old_job.output_file_id is not None
    items = "SELECT count(*) FROM items WHERE job_id = :j"
    attempts = (
        "SELECT count(*) FROM attempts a JOIN items i ON i.id = a.item_id WHERE i.job_id = :j"
    )
    events = "SELECT count(*) FROM webhook_events WHERE job_id = :j"
    assert count_rows(repo, items, j=old) == 25
    assert count_rows(repo, attempts, j=old) == 25
    assert count_rows(repo, events, j=old) == 1

    # A tick deletes at most its rows (10, in chunks of 4): the big batch takes several.
    first = tick(repo, tick_ledger, s, clock=_still).purged
    assert first.jobs == 0
    assert 10 <= first.rows <= 12
    assert count_rows(repo, items, j=old) == 25 - first.rows
    ticks = 1
    while count_rows(repo, "SELECT count(*) FROM jobs WHERE id = :j", j=old) and ticks < 10:
        tick(repo, tick_ledger, s, clock=_still)
        ticks += 1
    assert ticks == 3
    for sql in (items, events, "SELECT count(*) FROM job_counters WHERE job_id = :j"):
        assert count_rows(repo, sql, j=old) == 0
    assert count_rows(repo, "SELECT count(*) FROM webhook_deliveries") == 1  # the recent one's
    assert (
        count_rows(repo, "SELECT count(*) FROM files WHERE id = :f", f=old_job.output_file_id) == 0
    )
    assert (
        count_rows(repo, "SELECT count(*) FROM files WHERE id = :f", f=old_job.input_file_id) == 1
    )
    # What ended since, or has not ended, stays whole.
    assert count_rows(repo, items, j=recent) == 3
    assert count_rows(repo, items, j=running) == 2
    assert {j.id for j in repo.jobs.list_jobs(tenant.id)} == {recent, running}
    # Retention 0 keeps everything.
    keep = s.model_copy(update={"retention_s": 0.0})
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET completed_at = now() - interval '400 days' WHERE id = :r"),
            {"r": recent},
        )
    assert tick(repo, tick_ledger, keep).purged.jobs == 0
    assert count_rows(repo, items, j=recent) == 3
