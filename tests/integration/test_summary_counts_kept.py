"""A summarisation job's counts are kept as its documents and steps move (triggers over each
statement, folded by its pages and its driver), so a status read costs a handful of rows
however large the job. Real Postgres.

Red before: every read counted the job's rows (a 715,827-document job: 154 ms over its
documents and 303 ms over its steps, for every poll of a status view).
"""

from __future__ import annotations

import pytest
from batch_api_support import run_worker

from backfill.config import Settings
from backfill.store import Repository
from backfill.summarize import driver, jobs
from backfill.summarize.states import DocumentState, SummaryJobState
from tests.integration.support_sql import count_rows
from tests.integration.support_summary_counts import counted_from_rows
from tests.integration.test_summary_jobs import LONG, SHAPE, SHORT, count
from tests.integration.test_summary_purge import _blocks

pytestmark = pytest.mark.usefixtures("summary_counts_checked")

DOCUMENTS = 20_000
PAGES = 10
# A read of the kept counts: the index probe and the few rows of one job (measured ~10).
READ_BOUND = 40


def _counted(repo: Repository, job_id: str) -> object:
    with repo.engine.connect() as conn:
        return counted_from_rows(conn, job_id)


def test_a_status_read_touches_a_handful_of_buffers_however_many_documents(
    database_url: str, settings: Settings
) -> None:
    setup = Repository.connect(database_url)
    try:
        tenant = setup.tenants.create_tenant("acme")
        request = jobs.SummaryJobRequest("tiny-model", "Summarise.", 64, "24h")
        job = jobs.create_job(setup, settings, tenant, request, SHAPE)
        per_page = DOCUMENTS // PAGES
        for page in range(PAGES):  # a statement a page, as the API stores them
            with setup.engine.begin() as conn:
                conn.exec_driver_sql(
                    "INSERT INTO summary_documents (job_id, seq, chunks, prompt_tokens) "
                    "SELECT %(j)s, g, 1 + (g %% 7 = 0)::int, 40 "
                    "FROM generate_series(%(a)s::int, %(b)s::int) g",
                    {"j": job.id, "a": page * per_page, "b": (page + 1) * per_page - 1},
                )
                conn.exec_driver_sql(
                    "INSERT INTO summary_steps (job_id, seq, node, body, line_bytes) "
                    "SELECT %(j)s, g, 0, 'x', 1 FROM generate_series(%(a)s::int, %(b)s::int) g",
                    {"j": job.id, "a": page * per_page, "b": (page + 1) * per_page - 1},
                )
        setup.summary_reports.fold_counts(job.id)
        expected = _counted(setup, job.id)
    finally:
        setup.close()

    reader = Repository.connect(database_url, pool_size=1)  # one backend: its reads counted
    try:
        reader.summary_reports.summary_counts(job.id)  # the connection's first use, apart
        _blocks(reader)  # and the statistics' (the catalog's first look-ups)
        before = _blocks(reader)
        counts = reader.summary_reports.summary_counts(job.id)
        touched = _blocks(reader) - before
    finally:
        reader.close()
    assert counts == expected
    assert counts.documents == {DocumentState.PENDING: DOCUMENTS}
    assert counts.split_documents == len(range(0, DOCUMENTS, 7))
    assert touched <= READ_BOUND, f"a status read touched {touched} buffers"


def test_pages_and_rounds_fold_a_jobs_counts_to_a_row_per_kind_and_state(
    repo: Repository, settings: Settings
) -> None:
    small = settings.model_copy(update={"max_lines_per_batch": 4, "node_live_s": 0.001})
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", SHAPE.summary_tokens, "1h")
    job = jobs.create_job(repo, small, tenant, request, SHAPE)
    for page, text_ in enumerate([LONG, *SHORT, "   "]):
        fresh = repo.summary_jobs.get_summary_job(None, job.id)
        jobs.add_documents(
            repo, small, tenant, fresh, [jobs.prepare_document(fresh, f"d{page}", text_, count)]
        )

    def rows() -> int:
        return count_rows(repo, "SELECT count(*) FROM summary_counts WHERE job_id = :j", j=job.id)

    groups = "SELECT count(DISTINCT (kind, state)) FROM summary_counts WHERE job_id = :j"
    # Seven pages, each a statement of documents and one of steps: folded as they came.
    assert rows() == count_rows(repo, groups, j=job.id) <= 4
    jobs.start_job(repo, small, tenant, repo.summary_jobs.get_summary_job(None, job.id))
    for _ in range(30):
        driver.drive(repo, small)
        assert rows() == count_rows(repo, groups, j=job.id), "a round left its rows unfolded"
        assert repo.summary_reports.summary_counts(job.id) == _counted(repo, job.id)
        if repo.summary_jobs.get_summary_job(None, job.id).state is not SummaryJobState.IN_PROGRESS:
            break
        run_worker(repo)
    counts = repo.summary_reports.summary_counts(job.id)
    assert repo.summary_jobs.get_summary_job(None, job.id).state is SummaryJobState.COMPLETED
    assert counts.documents == {DocumentState.SUCCEEDED: 6, DocumentState.FAILED: 1}
    assert counts.deepest_split >= 1
    assert counts.split_documents == 1
