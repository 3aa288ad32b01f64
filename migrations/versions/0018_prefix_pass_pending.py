"""the jobs a prefix pass has yet to take, found by an index (issue 36)

Every idle node's prefix finder asks for a job to look at whenever a claim comes back empty
(``Repository.prefixes.take_prefix_job``: an in-progress job no pass has taken yet). Without an index
that was a scan of every job the store keeps (retention keeps finished ones for 30 days);
this partial index holds only the jobs that wait for a pass, so the question costs the same
however many jobs are kept.

Revision ID: 0018_prefix_pass_pending
Revises: 0017_prefix_pass_ended
Create Date: 2026-12-06 21:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018_prefix_pass_pending"
down_revision: str | None = "0017_prefix_pass_ended"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index(
        "ix_jobs_prefix_pass_pending",
        "jobs",
        ["created_at", "id"],
        postgresql_where=sa.text("state = 'in_progress' AND prefixes_taken_at IS NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_prefix_pass_pending", table_name="jobs")
