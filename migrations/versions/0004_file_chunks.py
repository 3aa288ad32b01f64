"""file_chunks: input files stored as a sequence of pieces, streamed in and out

Revision ID: 0004_file_chunks
Revises: 0003_tenant_weights
Create Date: 2026-12-01 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_file_chunks"
down_revision: str | None = "0003_tenant_weights"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # One bytea per file made every upload, download and batch create hold the whole file
    # in the API's memory (and a slice of a compressed bytea decompresses all before it).
    # Files written from now on are pieces of Settings.file_chunk_bytes; files.content
    # still holds the bytes of files uploaded before, read as one piece.
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(length=40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(
            ["file_id"],
            ["files.id"],
            name=op.f("fk_file_chunks_file_id_files"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("file_id", "seq", name=op.f("pk_file_chunks")),
    )
    values = (
        op.get_bind()
        .execute(
            sa.text("SELECT enumvals FROM pg_settings WHERE name = 'default_toast_compression'")
        )
        .scalar()
    )
    if "lz4" in (values or []):
        op.execute("ALTER TABLE file_chunks ALTER COLUMN data SET COMPRESSION lz4")


def downgrade() -> None:
    op.drop_table("file_chunks")
