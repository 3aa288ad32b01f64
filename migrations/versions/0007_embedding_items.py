"""items may declare no output: an embedding (/v1/embeddings) generates nothing (issue 20)

Revision ID: 0007_embedding_items
Revises: 0006_webhooks
Create Date: 2026-12-02 06:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0007_embedding_items"
down_revision: str | None = "0006_webhooks"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.drop_constraint(op.f("ck_items_max_output_positive"), "items", type_="check")
    op.create_check_constraint(
        op.f("ck_items_max_output_not_negative"), "items", "max_output_tokens >= 0"
    )


def downgrade() -> None:
    # Embedding items cannot satisfy the old rule; a downgrade with some stored fails here.
    op.drop_constraint(op.f("ck_items_max_output_not_negative"), "items", type_="check")
    op.create_check_constraint(
        op.f("ck_items_max_output_positive"), "items", "max_output_tokens > 0"
    )
