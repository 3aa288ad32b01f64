"""A summarisation job started before its last document (``more_documents``): it runs what it
has while the rest are sent, judges each later page against its deadline, and completes only
once closed. Real Postgres, the real driver and the stand-in worker.

Red before: a job started only once every document was in (a start took no such option, and a
started job refused documents), so the engine sat idle while a large corpus was counted.
"""

from __future__ import annotations

import pytest
from batch_api_support import run_worker
from sqlalchemy import text

from backfill.config import Settings
from backfill.errors import StaleWrite
from backfill.refusals import DeadlineInfeasible
from backfill.store import Repository
from backfill.store.records import TenantRecord
from backfill.store.summaries import SummaryJobRecord
from backfill.summarize import driver, jobs
from backfill.summarize.states import DocumentState, SummaryJobState
from tests.integration.support_sql import query_rows
from tests.integration.test_summary_jobs import LONG, SHAPE, count

pytestmark = pytest.mark.usefixtures("summary_counts_checked")


@pytest.fixture
def small_batches(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_lines_per_batch": 4, "node_live_s": 0.001})


def _receiving(
    repo: Repository, settings: Settings, notes: list[str], window: str = "1h"
) -> tuple[TenantRecord, SummaryJobRecord]:
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", SHAPE.summary_tokens, window)
    job = jobs.create_job(repo, settings, tenant, request, SHAPE)
    _add(repo, settings, tenant, job, notes, "first")
    return tenant, repo.summary_jobs.get_summary_job(None, job.id)


def _add(
    repo: Repository,
    settings: Settings,
    tenant: TenantRecord,
    job: SummaryJobRecord,
    texts: list[str],
    name: str,
) -> None:
    job = repo.summary_jobs.get_summary_job(None, job.id)
    documents = [jobs.prepare_document(job, f"{name}{i}", t, count) for i, t in enumerate(texts)]
    jobs.add_documents(repo, settings, tenant, job, documents)


def _rounds(repo: Repository, settings: Settings, job_id: str, rounds: int = 12) -> SummaryJobState:
    for _ in range(rounds):
        driver.drive(repo, settings)
        state = repo.summary_jobs.get_summary_job(None, job_id).state
        if state is not SummaryJobState.IN_PROGRESS:
            return state
        run_worker(repo)
    return repo.summary_jobs.get_summary_job(None, job_id).state


def test_a_job_started_open_runs_its_first_documents_and_completes_only_once_closed(
    repo: Repository, small_batches: Settings
) -> None:
    tenant, job = _receiving(repo, small_batches, ["A short note.", "Another note."])
    started = jobs.start_job(repo, small_batches, tenant, job, more_documents=True)
    assert started.state is SummaryJobState.IN_PROGRESS
    assert started.documents_open

    # Its first documents are summarised while the rest are still to come; it does not end.
    assert _rounds(repo, small_batches, job.id) is SummaryJobState.IN_PROGRESS
    counts = repo.summary_reports.summary_counts(job.id)
    assert counts.documents == {DocumentState.SUCCEEDED: 2}

    # More come while it runs, a long one map-reduced among them, and run in its batches.
    _add(repo, small_batches, tenant, job, [LONG, "A third note."], "second")
    assert _rounds(repo, small_batches, job.id) is SummaryJobState.IN_PROGRESS
    assert repo.summary_reports.summary_counts(job.id).documents == {DocumentState.SUCCEEDED: 4}

    closed = jobs.close_documents(repo, tenant, job.id)
    assert not closed.documents_open
    assert _rounds(repo, small_batches, job.id) is SummaryJobState.COMPLETED
    rows = list(jobs.result_rows(repo, job.id))
    assert [r.id for r in rows] == ["first0", "first1", "second0", "second1"]
    assert rows[2].chunks > 1
    assert all(r.summary for r in rows)
    # Nothing doubled: every step ran once, in one batch.
    custom_ids = [
        r.custom_id
        for r in query_rows(
            repo,
            "SELECT i.custom_id FROM items i JOIN summary_batches b ON b.batch_id = i.job_id "
            "WHERE b.job_id = :j",
            j=job.id,
        )
    ]
    final = repo.summary_jobs.get_summary_job(None, job.id)
    assert len(custom_ids) == len(set(custom_ids)) == final.planned_steps

    with pytest.raises(StaleWrite, match="takes documents only while"):
        _add(repo, small_batches, tenant, job, ["Too late."], "late")


def test_a_page_that_would_miss_the_jobs_deadline_is_refused_whole_and_the_job_runs_on(
    repo: Repository, small_batches: Settings
) -> None:
    # 20 tokens a second in a 5-minute window: the first notes fit, a page of long reports
    # (thousands of tokens) does not.
    slow = small_batches.model_copy(update={"batch_throughput_tokens_per_s": 20.0})
    tenant, job = _receiving(repo, slow, ["A short note.", "Another note."], window="5m")
    jobs.start_job(repo, slow, tenant, job, more_documents=True)
    with pytest.raises(DeadlineInfeasible, match="by the job's deadline"):
        _add(repo, slow, tenant, job, [LONG, LONG + LONG], "late")
    documents = repo.summary_reports.summary_counts(job.id).documents
    assert sum(documents.values()) == 2  # nothing of the refused page was kept

    jobs.close_documents(repo, tenant, job.id)
    assert _rounds(repo, slow, job.id) is SummaryJobState.COMPLETED
    assert [r.id for r in jobs.result_rows(repo, job.id)] == ["first0", "first1"]


def test_expected_documents_has_the_start_judge_the_whole_job(
    repo: Repository, small_batches: Settings
) -> None:
    slow = small_batches.model_copy(update={"batch_throughput_tokens_per_s": 20.0})
    tenant, job = _receiving(repo, slow, ["A short note.", "Another note."], window="5m")
    # Two notes fit the window; a thousand like them do not: refused before anything runs.
    with pytest.raises(DeadlineInfeasible, match="earliest feasible"):
        jobs.start_job(repo, slow, tenant, job, more_documents=True, expected_documents=1000)
    assert repo.summary_jobs.get_summary_job(None, job.id).state is SummaryJobState.RECEIVING
    started = jobs.start_job(repo, slow, tenant, job, more_documents=True, expected_documents=3)
    assert started.state is SummaryJobState.IN_PROGRESS


def test_an_open_job_whose_sender_went_away_expires_at_its_deadline(
    repo: Repository, small_batches: Settings
) -> None:
    tenant, job = _receiving(repo, small_batches, ["A short note."])
    jobs.start_job(repo, small_batches, tenant, job, more_documents=True)
    assert _rounds(repo, small_batches, job.id) is SummaryJobState.IN_PROGRESS
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE summary_jobs SET deadline = now() - interval '1 second' WHERE id = :j"),
            {"j": job.id},
        )
    driver.drive(repo, small_batches)
    ended = repo.summary_jobs.get_summary_job(None, job.id)
    assert ended.state is SummaryJobState.COMPLETED  # what it had was all summarised
    assert not ended.documents_open
    with pytest.raises(StaleWrite):
        _add(repo, small_batches, tenant, job, ["Too late."], "late")


def test_closing_asks_for_a_start_first_and_a_second_close_changes_nothing(
    repo: Repository, small_batches: Settings
) -> None:
    tenant, job = _receiving(repo, small_batches, ["A short note."])
    with pytest.raises(StaleWrite, match="start it"):
        jobs.close_documents(repo, tenant, job.id)
    with pytest.raises(Exception, match="expected_documents goes with more_documents"):
        jobs.start_job(repo, small_batches, tenant, job, expected_documents=5)
    jobs.start_job(repo, small_batches, tenant, job, more_documents=True)
    assert not jobs.close_documents(repo, tenant, job.id).documents_open
    assert not jobs.close_documents(repo, tenant, job.id).documents_open
    assert _rounds(repo, small_batches, job.id) is SummaryJobState.COMPLETED
