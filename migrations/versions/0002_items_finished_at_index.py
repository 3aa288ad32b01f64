"""items finished_at index, for the metrics collector

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # /metrics reads the items finished since its last scrape (token histograms, useful
    # tokens per second); without this index each scrape would scan the whole items table.
    op.create_index(
        "ix_items_finished_at",
        "items",
        ["finished_at"],
        unique=False,
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_items_finished_at",
        table_name="items",
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
