"""How a summarisation job's steps and documents end: the reduce driver's harvest of the steps
whose items ended, and the decisions it writes back.

A step's key ``(job, document, node)`` is what keeps the driver from making a step twice:
steps are inserted ``ON CONFLICT DO NOTHING``. A step that ends marks its document
(``touched``) for the driver, in the same transaction; deciding on a document unmarks it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import text

from backfill.store.database import Store
from backfill.store.summaries.jobs import INSERT_STEP
from backfill.store.summaries.records import DocumentRow, FinishedStep, NewStep
from backfill.summarize.decide import StepView
from backfill.summarize.prompts import LINE_OVERHEAD
from backfill.summarize.states import StepState

# Pending steps whose item ended, or whose batch ended without an item for them.
FINISHED_STEPS = (
    "SELECT s.seq, s.node, i.state AS item_state, j.state AS batch_state, i.result, i.error "
    "FROM summary_steps s "
    "JOIN summary_batches b ON b.job_id = s.job_id AND b.batch_no = s.batch_no "
    "JOIN jobs j ON j.id = b.batch_id "
    "LEFT JOIN items i ON i.job_id = b.batch_id AND i.custom_id = s.seq || ':' || s.node "
    "WHERE s.job_id = :i AND s.state = 'pending' AND ("
    "  i.state IN ('succeeded', 'failed', 'expired', 'cancelled') "
    "  OR (i.id IS NULL AND j.state IN ('failed', 'expired', 'cancelled', 'completed'))"
    ") ORDER BY s.seq, s.node LIMIT :n"
)
END_STEP = (
    "UPDATE summary_steps SET state = :state, summary = :summary, error = :error, "
    "prompt_tokens = :pt, completion_tokens = :ct "
    "WHERE job_id = :i AND seq = :seq AND node = :node AND state = 'pending'"
)
TOUCH_DOCUMENTS = (
    "UPDATE summary_documents SET touched = true WHERE job_id = :i AND state = 'pending' "
    "AND seq = ANY(CAST(:seqs AS int[]))"
)
TOUCHED = (
    "SELECT seq, chunks FROM summary_documents WHERE job_id = :i AND touched ORDER BY seq LIMIT :n"
)
STEPS_OF = (
    "SELECT seq, node, state, summary, error, prompt_tokens, completion_tokens "
    "FROM summary_steps WHERE job_id = :i AND seq = ANY(CAST(:seqs AS int[]))"
)
DECIDED = "UPDATE summary_documents SET touched = false WHERE job_id = :i AND seq = :seq"
END_DOCUMENT = (
    "UPDATE summary_documents SET state = :state, summary = :summary, error = :error, "
    "prompt_tokens = :pt, completion_tokens = :ct, split_depth = :depth, touched = false "
    "WHERE job_id = :i AND seq = :seq AND state = 'pending'"
)
# Pending steps no batch was made for (none numbered, or numbered and not made).
FAIL_UNMADE = (
    "UPDATE summary_steps s SET state = 'failed', error = :error "
    "WHERE s.job_id = :i AND s.state = 'pending' AND (s.batch_no IS NULL OR EXISTS ("
    "  SELECT 1 FROM summary_batches b WHERE b.job_id = s.job_id AND b.batch_no = s.batch_no "
    "  AND b.batch_id IS NULL)) RETURNING s.seq"
)
FAIL_PENDING = (
    "UPDATE summary_documents SET state = 'failed', error = :error, touched = false "
    "WHERE job_id = :i AND state = 'pending'"
)


class SummaryOutcomes(Store):
    """Steps that ended, recorded; documents decided on, ended or failed."""

    def finished_steps(self, job_id: str, limit: int) -> list[FinishedStep]:
        with self._tx() as conn:
            rows = conn.execute(text(FINISHED_STEPS), {"i": job_id, "n": limit}).all()
        return [
            FinishedStep(r.seq, r.node, r.item_state, r.batch_state, r.result, r.error)
            for r in rows
        ]

    def end_steps(self, job_id: str, outcomes: Mapping[tuple[int, int], StepView]) -> None:
        """Record how steps ended and mark their documents for the driver, in one
        transaction (a step already ended is left as it is)."""
        if not outcomes:
            return
        with self._tx() as conn:
            conn.execute(
                text(END_STEP),
                [
                    {
                        "i": job_id,
                        "seq": seq,
                        "node": node,
                        "state": view.state.value,
                        "summary": view.summary,
                        "error": view.error,
                        "pt": view.prompt_tokens,
                        "ct": view.completion_tokens,
                    }
                    for (seq, node), view in outcomes.items()
                ],
            )
            conn.execute(
                text(TOUCH_DOCUMENTS), {"i": job_id, "seqs": sorted({s for s, _ in outcomes})}
            )

    def touched_documents(self, job_id: str, limit: int) -> list[tuple[int, int]]:
        """``(seq, chunks)`` of the documents a step of which ended since the last decision."""
        with self._tx() as conn:
            rows = conn.execute(text(TOUCHED), {"i": job_id, "n": limit}).all()
        return [(r.seq, r.chunks) for r in rows]

    def steps_of(self, job_id: str, seqs: Sequence[int]) -> dict[int, dict[int, StepView]]:
        found: dict[int, dict[int, StepView]] = {seq: {} for seq in seqs}
        with self._tx() as conn:
            rows = conn.execute(text(STEPS_OF), {"i": job_id, "seqs": list(seqs)}).all()
        for r in rows:
            found[r.seq][r.node] = StepView(
                StepState(r.state), r.summary, r.prompt_tokens, r.completion_tokens, r.error
            )
        return found

    def decide_documents(
        self,
        job_id: str,
        new_steps: Mapping[int, Sequence[NewStep]],
        ended: Mapping[int, DocumentRow],
    ) -> None:
        """Apply the driver's decisions in one transaction: the new reduce steps (a step
        made before is not made again), the documents that ended, and every document
        decided on unmarked."""
        with self._tx() as conn:
            steps = [
                {
                    "i": job_id,
                    "seq": seq,
                    "node": s.node,
                    "body": s.body.decode(),
                    "bytes": len(s.body) + LINE_OVERHEAD,
                }
                for seq, made in new_steps.items()
                for s in made
            ]
            if steps:
                conn.execute(text(INSERT_STEP), steps)
            for seq in set(new_steps) - set(ended):
                conn.execute(text(DECIDED), {"i": job_id, "seq": seq})
            for seq, doc in ended.items():
                conn.execute(
                    text(END_DOCUMENT),
                    {
                        "i": job_id,
                        "seq": seq,
                        "state": doc.state.value,
                        "summary": doc.summary,
                        "error": doc.error,
                        "pt": doc.prompt_tokens,
                        "ct": doc.completion_tokens,
                        "depth": doc.split_depth,
                    },
                )

    def fail_unmade_steps(self, job_id: str, error: str) -> int:
        """Fail the pending steps no batch was made for, and mark their documents for the
        driver, in one transaction; returns how many."""
        with self._tx() as conn:
            seqs = list(conn.execute(text(FAIL_UNMADE), {"i": job_id, "error": error}).scalars())
            if seqs:
                conn.execute(text(TOUCH_DOCUMENTS), {"i": job_id, "seqs": sorted(set(seqs))})
        return len(seqs)

    def fail_pending_documents(self, job_id: str, error: str) -> int:
        with self._tx() as conn:
            return conn.execute(text(FAIL_PENDING), {"i": job_id, "error": error}).rowcount
