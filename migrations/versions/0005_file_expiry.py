"""files expire (OpenAI's expires_after and a batch's output_expires_after), and the batch
counts its usage (prompt tokens of the requests that succeeded); issue 20

Revision ID: 0005_file_expiry
Revises: 0004_file_chunks
Create Date: 2026-12-02 03:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_file_expiry"
down_revision: str | None = "0004_file_chunks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("files", sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
    op.create_index(
        "ix_files_expires",
        "files",
        ["expires_at"],
        unique=False,
        postgresql_where=sa.text("expires_at IS NOT NULL"),
    )
    op.add_column("jobs", sa.Column("output_expires_after_s", sa.Integer(), nullable=True))
    op.add_column(
        "job_counters",
        sa.Column("input_tokens", sa.BigInteger(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("job_counters", "input_tokens")
    op.drop_column("jobs", "output_expires_after_s")
    op.drop_index("ix_files_expires", table_name="files")
    op.drop_column("files", "expires_at")
