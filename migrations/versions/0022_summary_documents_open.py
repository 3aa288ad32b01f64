"""a summarisation job started before its last document (issue 37)

A job's documents are counted by the engine as they are sent, and a job used to start only
once the last of them was in: 2,000 documents kept the engine idle ~20 s before the first map
step ran. ``documents_open`` marks a job started with more documents to come: it takes pages
while it runs (each judged against the job's deadline as it comes), and it cannot complete
until it is closed.

Revision ID: 0022_summary_documents_open
Revises: 0021_items_job_prefix
Create Date: 2026-12-07 13:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0022_summary_documents_open"
down_revision: str | None = "0021_items_job_prefix"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "summary_jobs",
        sa.Column("documents_open", sa.Boolean(), server_default=sa.false(), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("summary_jobs", "documents_open")
