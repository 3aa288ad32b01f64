"""an event when a webhook endpoint is disabled (issue 35)

An endpoint whose every attempt failed for ``BACKFILL_WEBHOOKS_DISABLE_AFTER_S`` is disabled;
its tenant saw that only by reading the endpoint. Now the transaction that disables it also
writes a ``webhook_endpoint.disabled`` event, delivered to the tenant's endpoints that
subscribed to that type by name (it is in no endpoint's default subscription: OpenAI sends no
such event, and an SDK receiver that accepts every type it knows would meet one it does not).
Such an event belongs to no batch (``job_id`` NULL): ``subject_id`` names the endpoint, and the
retention purge finds these events by age (``ix_webhook_events_unowned_created``).

Revision ID: 0024_webhook_endpoint_events
Revises: 0023_summary_counts
Create Date: 2026-12-07 17:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0024_webhook_endpoint_events"
down_revision: str | None = "0023_summary_counts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column("webhook_events", "job_id", existing_type=sa.String(40), nullable=True)
    op.add_column("webhook_events", sa.Column("subject_id", sa.String(length=40)))
    op.create_check_constraint(
        "subject", "webhook_events", "job_id IS NOT NULL OR subject_id IS NOT NULL"
    )
    op.create_index(
        "ix_webhook_events_unowned_created",
        "webhook_events",
        ["created_at"],
        postgresql_where=sa.text("job_id IS NULL"),
    )


def downgrade() -> None:
    op.execute("DELETE FROM webhook_events WHERE job_id IS NULL")
    op.drop_index("ix_webhook_events_unowned_created", table_name="webhook_events")
    op.drop_constraint("subject", "webhook_events", type_="check")
    op.drop_column("webhook_events", "subject_id")
    op.alter_column("webhook_events", "job_id", existing_type=sa.String(40), nullable=False)
