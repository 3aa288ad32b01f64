"""a summarisation job's counts kept as it runs, not counted at every read (issue 37)

A job's status (its documents and steps by state, its tokens, its split documents) was
counted from its rows at every read: for a 715,827-document job, 154 ms over its documents
and 303 ms over its steps, for every poll of a status view or the dashboard. Now every
statement that writes a job's documents or steps adds what it changed to
``summary_counts`` (statement triggers over the rows it wrote: one row per state it moved
something into or out of); the driver folds a job's rows into one per kind and state as it
goes, so a read sums a handful of rows. Rows are only ever deleted with their job (the
retention purge), so no trigger counts deletes.

Revision ID: 0023_summary_counts
Revises: 0022_summary_documents_open
Create Date: 2026-12-07 16:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0023_summary_counts"
down_revision: str | None = "0022_summary_documents_open"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = "job_id, kind, state, n, prompt_tokens, completion_tokens, split, deepest, unbatched"

# What a statement changed, one row per (job, state) that moved: +1 per row written as it is
# now, -1 per row as it was. A statement that moved nothing counted (``touched``, a body
# dropped) adds no row.
DOCUMENT_ROWS = """
    SELECT job_id, state, 1 AS n, prompt_tokens AS pt, completion_tokens AS ct,
           (chunks > 1)::int AS split, split_depth AS depth FROM new_rows
"""
OLD_DOCUMENT_ROWS = """
    SELECT job_id, state, -1, -prompt_tokens, -completion_tokens, -(chunks > 1)::int, 0
    FROM old_rows
"""
STEP_ROWS = "SELECT job_id, state, 1 AS n, (batch_no IS NULL)::int AS unbatched FROM new_rows"
OLD_STEP_ROWS = "SELECT job_id, state, -1, -(batch_no IS NULL)::int FROM old_rows"


def _document_function(name: str, rows: str) -> str:
    return f"""
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO summary_counts ({COLUMNS})
  SELECT job_id, 'document', state, sum(n), sum(pt), sum(ct), sum(split), max(depth), 0
  FROM ({rows}) d GROUP BY job_id, state
  HAVING sum(n) <> 0 OR sum(pt) <> 0 OR sum(ct) <> 0 OR sum(split) <> 0;
  RETURN NULL;
END $$
"""


def _step_function(name: str, rows: str) -> str:
    return f"""
CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO summary_counts ({COLUMNS})
  SELECT job_id, 'step', state, sum(n), 0, 0, 0, 0, sum(unbatched)
  FROM ({rows}) d GROUP BY job_id, state
  HAVING sum(n) <> 0 OR sum(unbatched) <> 0;
  RETURN NULL;
END $$
"""


TRIGGERS = (
    ("summary_documents", "INSERT", "summary_documents_added", DOCUMENT_ROWS, _document_function),
    (
        "summary_documents",
        "UPDATE",
        "summary_documents_moved",
        f"{DOCUMENT_ROWS} UNION ALL {OLD_DOCUMENT_ROWS}",
        _document_function,
    ),
    ("summary_steps", "INSERT", "summary_steps_added", STEP_ROWS, _step_function),
    (
        "summary_steps",
        "UPDATE",
        "summary_steps_moved",
        f"{STEP_ROWS} UNION ALL {OLD_STEP_ROWS}",
        _step_function,
    ),
)

# The counts of the jobs there already, one row per kind and state.
BACKFILL_COUNTS = f"""
INSERT INTO summary_counts ({COLUMNS})
SELECT job_id, 'document', state, count(*), coalesce(sum(prompt_tokens), 0),
       coalesce(sum(completion_tokens), 0), count(*) FILTER (WHERE chunks > 1),
       coalesce(max(split_depth), 0), 0
FROM summary_documents GROUP BY job_id, state
UNION ALL
SELECT job_id, 'step', state, count(*), 0, 0, 0, 0, count(*) FILTER (WHERE batch_no IS NULL)
FROM summary_steps GROUP BY job_id, state
"""


def upgrade() -> None:
    op.create_table(
        "summary_counts",
        sa.Column("id", sa.BigInteger(), sa.Identity(), primary_key=True),
        sa.Column(
            "job_id",
            sa.String(length=40),
            sa.ForeignKey("summary_jobs.id", ondelete="CASCADE"),
            nullable=False,
        ),
        sa.Column("kind", sa.String(length=8), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("split", sa.BigInteger(), nullable=False),
        sa.Column("deepest", sa.Integer(), nullable=False),
        sa.Column("unbatched", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_summary_counts_job", "summary_counts", ["job_id"])
    for table, event, name, rows, function in TRIGGERS:
        referencing = "NEW TABLE AS new_rows" + (
            " OLD TABLE AS old_rows" if event == "UPDATE" else ""
        )
        op.execute(function(name, rows))
        op.execute(
            f"CREATE TRIGGER {name} AFTER {event} ON {table} REFERENCING {referencing} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {name}()"
        )
    op.execute(BACKFILL_COUNTS)


def downgrade() -> None:
    for table, _, name, _, _ in TRIGGERS:
        op.execute(f"DROP TRIGGER {name} ON {table}")
        op.execute(f"DROP FUNCTION {name}()")
    op.drop_index("ix_summary_counts_job", table_name="summary_counts")
    op.drop_table("summary_counts")
