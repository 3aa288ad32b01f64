"""a job remembers when the pass that looked for its shared prompt prefixes ended (issue 36)

A node that looks for shared prefixes leaves a new job's items in the queue, for a few seconds
at most, until its prefix pass has ended (found, found none, or failed): items claimed before
it reserve their whole prompts. ``jobs.prefixes_ended_at`` is that end (NULL: not yet, or
never: the bound then lets the claims go on).

Revision ID: 0017_prefix_pass_ended
Revises: 0016_summary_sampling
Create Date: 2026-12-06 17:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017_prefix_pass_ended"
down_revision: str | None = "0016_summary_sampling"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("prefixes_ended_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    op.drop_column("jobs", "prefixes_ended_at")
