"""The purge finds the batches due for it by an index, not by reading every job.

Each maintenance tick asks for the ended batches past their retention, oldest end first.
Retention keeps every ended batch for 30 days, so the jobs table holds a month of them (three
million at 100,000 batches a day): without an index on the end, each tick (one a second) read
them all to find a hundred.
"""

from __future__ import annotations

from sqlalchemy import text

from backfill.store import Repository
from backfill.store.retention import DUE_JOBS


def test_the_ended_batches_due_for_the_purge_are_found_by_an_index(repo: Repository) -> None:
    with repo.engine.begin() as conn:
        # Any plan but reading the whole table, where one exists.
        conn.execute(text("SET LOCAL enable_seqscan = off"))
        plan = "\n".join(
            conn.execute(text(f"EXPLAIN {DUE_JOBS}"), {"age": 30 * 86_400.0, "l": 100}).scalars()
        )
    assert "ix_jobs_ended" in plan, plan
    assert "Seq Scan" not in plan, plan
    assert "Sort" not in plan, plan  # in the index's order: no sort of every ended job
