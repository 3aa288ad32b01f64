"""A summarisation job past its retention is purged in key order, each chunk starting past the
last row the one before it deleted: a chunk that took "any :n of the job's rows" walked every
index entry the chunks before it had left dead, which stay while any older snapshot is open (a
long report, a replica's feedback, a backup): a 40,000-document job's steps and documents, 100
rows a chunk, took 15.7 s to purge, 1.5 s in key order (issue 35)."""

from __future__ import annotations

import pytest
import sqlalchemy
from sqlalchemy import text

from backfill.config import Settings
from backfill.purge_pace import PurgePace
from backfill.store import Repository
from backfill.summarize import jobs
from backfill.summarize.job_plan import JobShape
from tests.integration.support_sql import count_rows

pytestmark = pytest.mark.usefixtures("summary_counts_checked")

SHAPE = JobShape(
    context_tokens=400, map_prompt_tokens=20, reduce_prompt_tokens=40, summary_tokens=64
)
DOCUMENTS = 6_000
"""Each with two steps: 18,000 rows, in chunks of 100."""
SMALL_CHUNKS = PurgePace(budget_s=1e9, target_s=1e9, max_rows=100, rows_per_tick=10**9)


def _ended_job(repo: Repository, settings: Settings) -> str:
    """A summary job of ``DOCUMENTS`` documents, two steps each, ended 40 days ago."""
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest("m", "Summarise.", 64, "1h")
    job = jobs.create_job(repo, settings, tenant, request, SHAPE)
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO summary_documents (job_id, seq, source_id) "
                "SELECT :j, g, 'd' || g FROM generate_series(0, :n - 1) g"
            ),
            {"j": job.id, "n": DOCUMENTS},
        )
        conn.execute(
            text(
                "INSERT INTO summary_steps (job_id, seq, node, body, line_bytes) "
                "SELECT :j, g, k, 'x', 1 FROM generate_series(0, :n - 1) g, generate_series(0, 1) k"
            ),
            {"j": job.id, "n": DOCUMENTS},
        )
        conn.execute(
            text(
                "UPDATE summary_jobs SET state = 'completed', "
                "ended_at = now() - interval '40 days' WHERE id = :j"
            ),
            {"j": job.id},
        )
    return job.id


def _blocks(repo: Repository) -> int:
    """Buffers this database's backends have touched, flushed first (the repository has one
    connection: the purge's own backend)."""
    with repo.engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_force_next_flush()"))
        conn.commit()
        row = conn.execute(
            text(
                "SELECT blks_hit + blks_read FROM pg_stat_database "
                "WHERE datname = current_database()"
            )
        ).one()
    return int(row[0])


def test_a_summary_jobs_chunks_do_not_walk_the_rows_earlier_chunks_deleted(
    database_url: str, settings: Settings
) -> None:
    setup = Repository.connect(database_url, pool_size=1)
    try:
        job = _ended_job(setup, settings)
    finally:
        setup.close()
    purge = Repository.connect(database_url, pool_size=1)  # one backend: its reads counted
    snapshot = sqlalchemy.create_engine(database_url)
    held = snapshot.connect()
    try:
        # An older snapshot stays open throughout: the deleted rows' index entries stay.
        held.execute(text("BEGIN ISOLATION LEVEL REPEATABLE READ"))
        held.execute(text("SELECT count(*) FROM tenants"))
        before = _blocks(purge)
        deleted = 0
        while True:
            report = purge.retention.purge_ended_jobs(0, SMALL_CHUNKS)
            deleted += report.rows
            if report.stopped is None:
                break
        touched = _blocks(purge) - before
    finally:
        held.rollback()
        held.close()
        snapshot.dispose()
        left = count_rows(purge, "SELECT count(*) FROM summary_jobs WHERE id = :j", j=job)
        purge.close()
    assert deleted == 3 * DOCUMENTS
    assert left == 0
    # ~7 a row in key order; red before: ~45 a row, growing with the job (each chunk walked
    # the dead entries of all before it).
    assert touched <= 15 * deleted, touched / deleted
