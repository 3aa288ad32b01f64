"""a summarisation job's sampling settings, given to every step it makes (issue 37)

A job may name sampling settings (temperature, repetition_penalty, ...) once; every map and
reduce step's request carries them. Jobs created before have none (the engine's defaults).

Revision ID: 0016_summary_sampling
Revises: 0015_prefix_groups
Create Date: 2026-12-06 11:15:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0016_summary_sampling"
down_revision: str | None = "0015_prefix_groups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "summary_jobs",
        sa.Column("sampling", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    )


def downgrade() -> None:
    op.drop_column("summary_jobs", "sampling")
