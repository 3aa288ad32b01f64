"""the ended jobs the retention purge takes, found by an index (issue 35)

Each maintenance tick asks for the ended batches past their retention, oldest end first
(``backfill.store.retention.DUE_JOBS``). Retention keeps every ended batch for 30 days, so the
jobs table holds a month of them; without this index each tick read every job to find a
hundred.

Revision ID: 0020_jobs_ended
Revises: 0019_prefix_pass_frontier
Create Date: 2026-12-07 09:50:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0020_jobs_ended"
down_revision: str | None = "0019_prefix_pass_frontier"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_ended",
        "jobs",
        [sa.text("COALESCE(completed_at, failed_at, expired_at, cancelled_at, created_at)")],
        postgresql_where=sa.text("state IN ('cancelled', 'completed', 'expired', 'failed')"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_ended", table_name="jobs")
