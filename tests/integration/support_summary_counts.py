"""A summarisation job's counts as kept (``summary_counts``, by triggers) against its rows
counted: the check every summary test module runs after each test
(``summary_counts_checked``)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import create_engine, text

from backfill.store import Repository
from backfill.store.summaries import SummaryCounts
from backfill.summarize.states import DocumentState, StepState

# The read before the counts were kept: every document and step of the job, counted.
DOCUMENTS_COUNTED = (
    "SELECT state, count(*) AS n, coalesce(sum(prompt_tokens), 0) AS pt, "
    "coalesce(sum(completion_tokens), 0) AS ct, count(*) FILTER (WHERE chunks > 1) AS split, "
    "coalesce(max(split_depth), 0) AS depth FROM summary_documents WHERE job_id = :i "
    "GROUP BY state"
)
STEPS_COUNTED = (
    "SELECT state, count(*) AS n, count(*) FILTER (WHERE batch_no IS NULL) AS unbatched "
    "FROM summary_steps WHERE job_id = :i GROUP BY state"
)


def counted_from_rows(conn: Any, job_id: str) -> SummaryCounts:
    docs = conn.execute(text(DOCUMENTS_COUNTED), {"i": job_id}).all()
    steps = conn.execute(text(STEPS_COUNTED), {"i": job_id}).all()
    return SummaryCounts(
        documents={DocumentState(r.state): int(r.n) for r in docs},
        steps={StepState(r.state): int(r.n) for r in steps},
        unbatched_steps=sum(int(r.unbatched) for r in steps),
        prompt_tokens=sum(int(r.pt) for r in docs),
        completion_tokens=sum(int(r.ct) for r in docs),
        split_documents=sum(int(r.split) for r in docs),
        deepest_split=max((int(r.depth) for r in docs), default=0),
    )


def kept_counts_differ(database_url: str) -> dict[str, tuple[SummaryCounts, SummaryCounts]]:
    """Every summary job of the database whose kept counts are not its rows' counts: (kept,
    counted) by job id."""
    repo = Repository.connect(database_url, pool_size=1)
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            ids = list(conn.execute(text("SELECT id FROM summary_jobs")).scalars())
            differ = {}
            for job_id in ids:
                kept = repo.summary_reports.summary_counts(job_id)
                counted = counted_from_rows(conn, job_id)
                if kept != counted:
                    differ[job_id] = (kept, counted)
        return differ
    finally:
        engine.dispose()
        repo.close()
