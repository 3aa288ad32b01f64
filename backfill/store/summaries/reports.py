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
# A job's counts: the sums of what the statements that wrote its documents and steps
# changed (kept by triggers, migration 0023_summary_counts), a handful of rows once folded.
COUNTS = (
    "SELECT kind, state, sum(n) AS n, sum(prompt_tokens) AS pt, sum(completion_tokens) AS ct, "
    "sum(split) AS split, max(deepest) AS depth, sum(unbatched) AS unbatched "
    "FROM summary_counts WHERE job_id = :i GROUP BY kind, state"
)
# The job's rows as one per kind and state (those that sum to nothing dropped). Rows a
# transaction still open adds are not seen, so not deleted: they are folded the next time.
FOLD_LOCK = "SELECT pg_advisory_xact_lock(hashtext('summary-counts:' || :i))"
FOLD_COUNTS = (
    "WITH gone AS (DELETE FROM summary_counts WHERE job_id = :i RETURNING *) "
    "INSERT INTO summary_counts (job_id, kind, state, n, prompt_tokens, completion_tokens, "
    "split, deepest, unbatched) "
    "SELECT :i, kind, state, sum(n), sum(prompt_tokens), sum(completion_tokens), sum(split), "
    "max(deepest), sum(unbatched) FROM gone GROUP BY kind, state "
    "HAVING sum(n) <> 0 OR sum(prompt_tokens) <> 0 OR sum(completion_tokens) <> 0 "
    "OR sum(split) <> 0 OR max(deepest) <> 0 OR sum(unbatched) <> 0"
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
        """The job's counts, from the rows its statements added (not from its documents)."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(COUNTS), {"i": job_id}).all()
        docs = [r for r in rows if r.kind == "document"]
        steps = [r for r in rows if r.kind == "step"]
        return SummaryCounts(
            documents={DocumentState(r.state): int(r.n) for r in docs if r.n},
            steps={StepState(r.state): int(r.n) for r in steps if r.n},
            unbatched_steps=sum(int(r.unbatched) for r in steps),
            prompt_tokens=sum(int(r.pt) for r in docs),
            completion_tokens=sum(int(r.ct) for r in docs),
            split_documents=sum(int(r.split) for r in docs),
            deepest_split=max((int(r.depth) for r in docs), default=0),
        )

    def fold_counts(self, job_id: str) -> None:
        """Fold the job's count rows into one per kind and state (its driver, as it goes: a
        read then sums a handful of rows, not one for each statement since the job began)."""
        with self._db.transaction() as conn:
            # One fold of a job at a time (a page's and its driver's may meet): two DELETEs
            # over the same rows in different orders could deadlock.
            conn.execute(text(FOLD_LOCK), {"i": job_id})
            conn.execute(text(FOLD_COUNTS), {"i": job_id})

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
