"""The prefix finder's question (an in-progress job no pass has taken yet) is answered from a
partial index of the jobs that wait for a pass, not by reading every job kept: every idle node
asks it whenever a claim comes back empty (issue 36)."""

from __future__ import annotations

from sqlalchemy import text

from backfill.store import Repository
from backfill.store.prefixes import _TAKE


def test_the_prefix_finders_question_reads_only_the_jobs_waiting_for_a_pass(
    repo: Repository,
) -> None:
    # Red before migration 0018: the plan read the jobs table whole (a scan, or a full
    # walk of another index filtered row by row), whatever the planner's costs.
    with repo.engine.connect() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(
            str(row[0]) for row in conn.execute(text("EXPLAIN " + _TAKE), {"m": ["any-model"]})
        )
    assert "ix_jobs_prefix_pass_pending" in plan, plan
