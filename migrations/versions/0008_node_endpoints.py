"""nodes say which batch endpoints their engine serves (issue 20)

A pooling engine serves /v1/embeddings and no generation; a generating one the reverse. NULL:
a node registered by a worker that did not ask (taken as serving every endpoint).

Revision ID: 0008_node_endpoints
Revises: 0007_embedding_items
Create Date: 2026-12-02 13:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008_node_endpoints"
down_revision: str | None = "0007_embedding_items"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("nodes", sa.Column("endpoints", postgresql.ARRAY(sa.Text()), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "endpoints")
