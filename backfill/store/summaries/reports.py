"""What is read of a summarisation job as it runs and once it ended: its counts and its
documents, a page at a time."""

from __future__ import annotations

from sqlalchemy import text

from backfill.store.database import Database
from backfill.store.summaries.records import DocumentRow, SummaryCounts
from backfill.summarize.states import DocumentState, StepState

ANY_PENDING = (
    "SELECT EXISTS (SELECT 1 FROM summary_documents WHERE job_id = :i AND state = 'pending')"
)
DOCUMENT_COUNTS = (
    "SELECT state, count(*) AS n, coalesce(sum(prompt_tokens), 0) AS pt, "
    "coalesce(sum(completion_tokens), 0) AS ct, count(*) FILTER (WHERE chunks > 1) AS split, "
    "coalesce(max(split_depth), 0) AS depth FROM summary_documents WHERE job_id = :i "
    "GROUP BY state"
)
STEP_COUNTS = (
    "SELECT state, count(*) AS n, count(*) FILTER (WHERE batch_no IS NULL) AS unbatched "
    "FROM summary_steps WHERE job_id = :i GROUP BY state"
)
DOCUMENT_PAGE = (
    "SELECT seq, source_id, state, chunks, split_depth, summary, error, prompt_tokens, "
    "completion_tokens FROM summary_documents WHERE job_id = :i AND seq > :after "
    "ORDER BY seq LIMIT :n"
)


class SummaryReports:
    """A job's counts of documents, steps and tokens, and its documents page by page."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def has_pending_documents(self, job_id: str) -> bool:
        """Whether a document of the job is still pending (an index probe)."""
        with self._db.transaction() as conn:
            return bool(conn.execute(text(ANY_PENDING), {"i": job_id}).scalar_one())

    def summary_counts(self, job_id: str) -> SummaryCounts:
        with self._db.transaction() as conn:
            docs = conn.execute(text(DOCUMENT_COUNTS), {"i": job_id}).all()
            steps = conn.execute(text(STEP_COUNTS), {"i": job_id}).all()
        return SummaryCounts(
            documents={DocumentState(r.state): int(r.n) for r in docs},
            steps={StepState(r.state): int(r.n) for r in steps},
            unbatched_steps=sum(int(r.unbatched) for r in steps),
            prompt_tokens=sum(int(r.pt) for r in docs),
            completion_tokens=sum(int(r.ct) for r in docs),
            split_documents=sum(int(r.split) for r in docs),
            deepest_split=max((int(r.depth) for r in docs), default=0),
        )

    def document_page(self, job_id: str, after_seq: int, limit: int) -> list[DocumentRow]:
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(DOCUMENT_PAGE), {"i": job_id, "after": after_seq, "n": limit}
            ).all()
        return [
            DocumentRow(
                r.seq,
                r.source_id,
                DocumentState(r.state),
                r.chunks,
                r.split_depth,
                r.summary,
                r.error,
                int(r.prompt_tokens),
                int(r.completion_tokens),
            )
            for r in rows
        ]
