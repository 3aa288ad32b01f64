"""how far a job's prefix pass has looked: claims take the items behind it (issue 36)

The pass over a job's items records each page's prefixes as the page ends, and its first record
ended the claims' hold on the whole job: a claim after it could take items the pass had not
reached yet, which then reserved their whole prompts. ``prefixes_upto`` is the last item id the
pass has recorded up to (its pages go in id order): while the pass runs, a node that looks for
prefixes claims only the items at or below it, so the pass's first page can be small (its first
claims start sooner) without costing the rest of the job its shared prefix.

Revision ID: 0019_prefix_pass_frontier
Revises: 0018_prefix_pass_pending
Create Date: 2026-12-07 09:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019_prefix_pass_frontier"
down_revision: str | None = "0018_prefix_pass_pending"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("jobs", sa.Column("prefixes_upto", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "prefixes_upto")
