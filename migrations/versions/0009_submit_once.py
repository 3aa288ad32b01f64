"""request bodies written once: items point at their body in the input file's pieces, and a
file records at upload the bound of the output tokens it asks for (issue 21)

An item's body is NULL while its bytes in the input file stand for it: ``body_seq`` is the
piece (``file_chunks.seq``), ``body_at`` and ``body_len`` the bytes there
(``backfill.store.bodies``). Pieces are stored uncompressed and out of line (STORAGE
EXTERNAL), so reading one body reads the few TOAST chunks under it, not the whole piece.
Deleting a file, or its expiry, first copies the bodies of its batches' unfinished items.

Revision ID: 0009_submit_once
Revises: 0008_node_endpoints
Create Date: 2026-12-03 05:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_submit_once"
down_revision: str | None = "0008_node_endpoints"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# An item's body in the input file (as backfill.store.bodies.ITEM_BODY, frozen here: a
# migration must not change when the module does).
_LINE_BODY = (
    "(SELECT convert_from(substring(c.data FROM i.body_at + 1 FOR i.body_len), 'UTF8') "
    "FROM jobs bj JOIN file_chunks c ON c.file_id = bj.input_file_id AND c.seq = i.body_seq "
    "WHERE bj.id = i.job_id)"
)


def upgrade() -> None:
    op.add_column("files", sa.Column("output_tokens_bound", sa.BigInteger(), nullable=True))
    op.create_index("ix_jobs_input_file", "jobs", ["input_file_id"], unique=False)
    op.alter_column("items", "body", existing_type=sa.Text(), nullable=True)
    op.add_column("items", sa.Column("body_seq", sa.Integer(), nullable=True))
    op.add_column("items", sa.Column("body_at", sa.Integer(), nullable=True))
    op.add_column("items", sa.Column("body_len", sa.Integer(), nullable=True))
    op.create_check_constraint(
        op.f("ck_items_body_kept"),
        "items",
        "body IS NOT NULL OR (body_seq IS NOT NULL AND body_at IS NOT NULL "
        "AND body_len IS NOT NULL)",
    )
    op.execute("ALTER TABLE file_chunks ALTER COLUMN data SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE file_chunks ALTER COLUMN data SET STORAGE EXTENDED")
    # Every body back in its item (an item of a deleted file that had already finished kept
    # none: it ran, and its body is read by nothing).
    op.execute(f"UPDATE items i SET body = coalesce({_LINE_BODY}, '{{}}') WHERE i.body IS NULL")
    op.drop_constraint(op.f("ck_items_body_kept"), "items", type_="check")
    op.drop_column("items", "body_len")
    op.drop_column("items", "body_at")
    op.drop_column("items", "body_seq")
    op.alter_column("items", "body", existing_type=sa.Text(), nullable=False)
    op.drop_index("ix_jobs_input_file", table_name="jobs")
    op.drop_column("files", "output_tokens_bound")
