"""webhook signing secrets sealed at rest (issue 35)

A sealed secret (``sealed:`` and a Fernet token, ``backfill.webhooks.sealing``) is ~170
characters, longer than the 100 a clear one needed: both secret columns become text. Secrets
already stored stay as they are until the sender seals them under the deployment's keys.

Revision ID: 0012_sealed_secrets
Revises: 0011_deferred_ingest
Create Date: 2026-12-06 05:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_sealed_secrets"
down_revision: str | None = "0011_deferred_ingest"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = ("secret", "previous_secret")


def upgrade() -> None:
    for column in _COLUMNS:
        op.alter_column("webhook_endpoints", column, type_=sa.Text(), existing_type=sa.String(100))


def downgrade() -> None:
    # A sealed secret does not fit the old width: downgrade only a deployment without keys.
    for column in _COLUMNS:
        op.alter_column("webhook_endpoints", column, type_=sa.String(100), existing_type=sa.Text())
