"""items remember the shared prompt prefix they start with (issue 36)

A job's items that share a prompt prefix (one instruction in front of each document) are
held once by the engine's prefix cache. ``prefix_id`` names the prefix (its tokens, model and
tenant: ``backfill.prefixes.prefix_id``) and ``prefix_blocks`` its length in whole KV blocks;
both NULL for an item that shares none, or whose prefix is not found yet.
``lease_prefix_tokens`` is what of the item's current lease is its shared prefix, held once
on its node by the ledger (0: the lease holds the whole prompt): a ledger rebuilt from
Postgres refers the lease to its prefix again. ``jobs.prefixes_taken_at`` is when a worker
took the job to find its prefixes (one worker looks, once).

Revision ID: 0015_prefix_groups
Revises: 0014_summary_jobs
Create Date: 2026-12-06 10:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_prefix_groups"
down_revision: str | None = "0014_summary_jobs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("items", sa.Column("prefix_id", sa.String(length=32), nullable=True))
    op.add_column("items", sa.Column("prefix_blocks", sa.Integer(), nullable=True))
    op.add_column(
        "items",
        sa.Column("lease_prefix_tokens", sa.Integer(), server_default="0", nullable=False),
    )
    op.add_column("jobs", sa.Column("prefixes_taken_at", sa.DateTime(timezone=True)))
    op.create_check_constraint(
        op.f("ck_items_prefix_whole"),
        "items",
        "(prefix_id IS NULL) = (prefix_blocks IS NULL) AND "
        "(prefix_blocks IS NULL OR prefix_blocks >= 1)",
    )


def downgrade() -> None:
    op.drop_constraint(op.f("ck_items_prefix_whole"), "items", type_="check")
    op.drop_column("jobs", "prefixes_taken_at")
    op.drop_column("items", "lease_prefix_tokens")
    op.drop_column("items", "prefix_blocks")
    op.drop_column("items", "prefix_id")
