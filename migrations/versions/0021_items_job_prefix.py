"""a job's shared prefixes read from an index of its grouped items (issue 36)

The Batch object's ``backfill.prefixes`` (every retrieve and list page) grouped a job's items
by prefix: the only index on a job's items is ``(job_id, state)``, so the query read every
item of the job and filtered out those without a prefix (100,000 items: 21-36 ms a retrieve,
``bench.status --quick`` p99 42 ms against 3 ms before prefixes were shown). This partial index
holds only the grouped items: a batch without groups reads none of its items for them, one with
groups reads the index.

Revision ID: 0021_items_job_prefix
Revises: 0020_jobs_ended
Create Date: 2026-12-07 11:25:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0021_items_job_prefix"
down_revision: str | None = "0020_jobs_ended"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_items_job_prefix",
        "items",
        ["job_id", "prefix_id", "prefix_blocks"],
        postgresql_where=sa.text("prefix_id IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_items_job_prefix", table_name="items")
