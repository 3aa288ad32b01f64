"""the claim path's attempts: no open-attempts index, half-full pages (issue 21)

An attempt's row is written when it starts and updated when it ends. ``ix_attempts_open``
(node, where ended_at IS NULL) had ``ended_at`` in its predicate, so every end was a non-HOT
update that wrote new entries into each index of the table; no statement reads that index
(every read of ``attempts`` goes by (item_id, attempt): EXPLAIN of the finish, start, reaper
and end-of-attempt statements, and 0 scans of it over a bench.claim run). Dropped, and with
half of each page left free, the end of an attempt is a HOT update: no index entry at all.

Revision ID: 0010_claim_fusion
Revises: 0009_submit_once
Create Date: 2026-12-03 04:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_claim_fusion"
down_revision: str | None = "0009_submit_once"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_index(
        "ix_attempts_open", table_name="attempts", postgresql_where=sa.text("ended_at IS NULL")
    )
    # Applies to pages written from now on; existing ones fill up as before.
    op.execute("ALTER TABLE attempts SET (fillfactor = 50)")


def downgrade() -> None:
    op.execute("ALTER TABLE attempts RESET (fillfactor)")
    op.create_index(
        "ix_attempts_open",
        "attempts",
        ["node"],
        unique=False,
        postgresql_where=sa.text("ended_at IS NULL"),
    )
