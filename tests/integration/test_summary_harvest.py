"""The reduce driver's harvest reads a batch's items once a round, not once per pending step:
a join of steps to items by custom id (``seq:node``, which no index of ``items`` holds) read
every item of the batch for every pending step, ~160 ms a round for one 327-line batch on a
2-core machine, twice a second through a summary job's map wave, on the engine's own cores
(issue 37)."""

from __future__ import annotations

import time

import pytest
from batch_api_support import run_worker
from sqlalchemy import text

from backfill.config import Settings
from backfill.store import Repository
from backfill.store.summaries.outcomes import FULL_READ_EVERY_S
from backfill.summarize import driver, jobs
from backfill.summarize.job_plan import JobShape
from backfill.summarize.states import StepState
from tests.integration.support_sql import query_one

pytestmark = pytest.mark.usefixtures("summary_counts_checked")

SHAPE = JobShape(
    context_tokens=400, map_prompt_tokens=20, reduce_prompt_tokens=40, summary_tokens=64
)
STEPS = 400
"""A map wave's batch (the bench's is 327 lines)."""


def count(text_: str) -> int:
    return 1 + len(text_.split())


def _items_read(repo: Repository) -> int:
    """Rows of ``items`` this database's backends have read, flushed first (the repository
    has one connection: the harvest's own backend)."""
    with repo.engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.commit()
    row = query_one(
        repo,
        "SELECT coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0) "
        "FROM pg_stat_user_tables WHERE relname = 'items'",
    )
    return int(row[0])


def test_a_round_reads_each_item_of_the_batch_once_not_once_per_pending_step(
    repo: Repository, database_url: str, settings: Settings
) -> None:
    settings = settings.model_copy(update={"node_live_s": 0.001})
    job_id = _wave(repo, settings)
    run_worker(repo, limit=STEPS // 2)  # half the wave ended, half still to come

    alone = Repository.connect(database_url, pool_size=1)  # one backend: its reads counted
    try:
        before = _items_read(alone)
        found = alone.summary_outcomes.finished_steps(job_id, 10_000)
        read = _settled_items_read(alone) - before
    finally:
        alone.close()
    assert len(found) == STEPS // 2
    assert all(f.item_state == "succeeded" and f.result for f in found)
    # Red before: ~40,000 rows (each of 200 pending steps walked the batch's items).
    assert read <= 3 * STEPS, read


def test_the_job_ends_every_step_harvested_and_a_failed_batchs_steps_failed_by_it(
    repo: Repository, settings: Settings
) -> None:
    small = settings.model_copy(update={"max_lines_per_batch": 7, "node_live_s": 0.001})
    job_id = _started(repo, small, [f"Note number {i}, short." for i in range(30)])
    batch_ids = repo.summary_batches.summary_batch_ids(job_id)
    assert len(batch_ids) == 5  # 30 steps, 7 a file
    # The first batch failed before any of its lines was stored (as a batch refused at
    # ingest does): its steps fail by it; the other batches' steps are harvested.
    with repo.engine.begin() as conn:
        conn.execute(text("DELETE FROM items WHERE job_id = :b"), {"b": batch_ids[0]})
        conn.execute(text("UPDATE jobs SET state = 'failed' WHERE id = :b"), {"b": batch_ids[0]})
    for _ in range(10):
        run_worker(repo)
        driver.drive(repo, small)
    steps = repo.summary_outcomes.steps_of(job_id, list(range(30)))
    assert {steps[i][0].error for i in range(7)} == {"its batch ended failed"}
    assert all(steps[i][0].state is StepState.FAILED for i in range(7))
    assert all(steps[i][0].state is StepState.SUCCEEDED for i in range(7, 30))
    rows = {r.id: r for r in jobs.result_rows(repo, job_id)}
    assert all(rows[f"n{i}"].summary is None for i in range(7))
    assert sorted(rows[f"n{i}"].summary or "" for i in range(7, 30)) == sorted(
        f"answer to {i}:0" for i in range(7, 30)
    )


def _wave(repo: Repository, settings: Settings) -> str:
    """A job of ``STEPS`` documents whose map wave is one batch, made."""
    job_id = _started(repo, settings, [f"Note {i}." for i in range(STEPS)])
    assert len(repo.summary_batches.summary_batch_ids(job_id)) == 1
    return job_id


def _started(repo: Repository, settings: Settings, notes: list[str]) -> str:
    """A job of ``notes``, started, its first round driven (its map batches made)."""
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", 64, "1h")
    job = jobs.create_job(repo, settings, tenant, request, SHAPE)
    jobs.add_documents(
        repo,
        settings,
        tenant,
        job,
        [jobs.prepare_document(job, f"n{i}", t, count) for i, t in enumerate(notes)],
    )
    jobs.start_job(repo, settings, tenant, repo.summary_jobs.get_summary_job(None, job.id))
    driver.drive(repo, settings)
    return job.id


def _steps_done(repo: Repository, job_id: str) -> int:
    return count_rows(
        repo,
        "SELECT count(*) FROM summary_steps WHERE job_id = :i AND state <> 'pending'",
        {"i": job_id},
    )


def _age_ends(repo: Repository, job_id: str, seconds: float) -> None:
    """The ends of the job's batch so far stamped ``seconds`` earlier."""
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE items SET finished_at = finished_at - make_interval(secs => :s) "
                "WHERE job_id = (SELECT batch_id FROM summary_batches WHERE job_id = :i) "
                "AND finished_at IS NOT NULL"
            ),
            {"i": job_id, "s": seconds},
        )


def _settled_items_read(repo: Repository) -> int:
    """:func:`_items_read` once the backends that closed have flushed theirs (they do as
    they exit, after the pool that closed them has returned)."""
    seen = _items_read(repo)
    for _ in range(20):
        time.sleep(0.25)
        now = _items_read(repo)
        if now == seen:
            return now
        seen = now
    return seen


def count_rows(repo: Repository, sql: str, params: dict[str, object]) -> int:
    with repo.engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


def test_a_round_after_the_first_reads_the_items_that_ended_since_not_the_batchs(
    repo: Repository, database_url: str, settings: Settings
) -> None:
    settings = settings.model_copy(update={"node_live_s": 0.001})
    job_id = _wave(repo, settings)
    run_worker(repo, limit=STEPS // 2)
    driver.drive(repo, settings)  # the first round reads everything that ended
    assert _steps_done(repo, job_id) == STEPS // 2
    _age_ends(repo, job_id, 60)  # as a wave's ends are, a minute into it
    run_worker(repo, limit=10)  # ten more end
    repo.engine.dispose()  # their backends' counts flushed as they close

    # One backend, its reads counted, planned as on a table of millions of items (here a few
    # hundred: a seq scan would read them all for any lookup).
    sep = "&" if "?" in database_url else "?"
    alone = Repository.connect(f"{database_url}{sep}options=-cenable_seqscan%3Doff", pool_size=1)
    try:
        before = _settled_items_read(alone)
        driver.drive_job(alone, settings, job_id)
        read = _settled_items_read(alone) - before
    finally:
        alone.close()
    assert _steps_done(repo, job_id) == STEPS // 2 + 10
    # Red before: the round read every ended item of the open batch (210 and more).
    assert read <= 60, read


def test_an_end_stamped_before_the_window_is_harvested_by_the_next_full_read(
    repo: Repository, settings: Settings
) -> None:
    settings = settings.model_copy(update={"node_live_s": 0.001})
    job_id = _wave(repo, settings)
    driver.drive(repo, settings)  # a full read: the window's mark set
    run_worker(repo, limit=1)
    _age_ends(repo, job_id, 3600)  # as an end whose transaction began an hour before
    driver.drive(repo, settings)
    assert _steps_done(repo, job_id) == 0  # the window does not reach it
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE summary_jobs SET harvest_full_at = harvest_full_at - "
                "make_interval(secs => :s) WHERE id = :i"
            ),
            {"i": job_id, "s": FULL_READ_EVERY_S},
        )
    driver.drive(repo, settings)
    assert _steps_done(repo, job_id) == 1
