"""batch creates whose file is large are ingested off the request path (issue 35)

A create answers ``validating`` after the cheap checks and leaves the file's validation and
item ingest to an ingest process (``backfill.ingester``), which claims the job with a session
advisory lock while it works: ``ingest_deferred`` marks such a job (the recovery of creates
that died mid-request leaves it to the ingesters), ``ingest_attempts`` counts the ingests
begun, so a file that takes an ingest process down each time fails its batch instead of
looping, and ``ingest_turn`` is its place among its tenant's queued creates when it was made
(tenants take turns: every tenant's first before anyone's second).

The webhook sender claims each endpoint's due deliveries in turn (one endpoint's backlog or a
slow endpoint's retries no longer hold the others): ``ix_webhook_deliveries_endpoint_due``.
An endpoint records since when its attempts fail (``failing_since``: its deliveries wait
behind healthy endpoints' and hold at most half the send slots) and is disabled after long
enough of it (``disabled_at``, ``disabled_reason``), as Standard Webhooks senders do.

Revision ID: 0011_deferred_ingest
Revises: 0010_claim_fusion
Create Date: 2026-12-06 01:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_deferred_ingest"
down_revision: str | None = "0010_claim_fusion"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column("ingest_deferred", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column(
        "jobs", sa.Column("ingest_attempts", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column(
        "jobs", sa.Column("ingest_turn", sa.Integer(), server_default="0", nullable=False)
    )
    op.create_index(
        "ix_jobs_ingest_queue",
        "jobs",
        ["ingest_turn", "created_at"],
        unique=False,
        postgresql_where=sa.text("state = 'validating' AND ingest_deferred"),
    )
    for column in ("failing_since", "disabled_at"):
        op.add_column(
            "webhook_endpoints", sa.Column(column, sa.DateTime(timezone=True), nullable=True)
        )
    op.add_column("webhook_endpoints", sa.Column("disabled_reason", sa.Text(), nullable=True))
    op.create_index(
        "ix_webhook_deliveries_endpoint_due",
        "webhook_deliveries",
        ["endpoint_id", "next_attempt_at"],
        unique=False,
        postgresql_where=sa.text("state = 'pending'"),
    )


def downgrade() -> None:
    for column in ("disabled_reason", "disabled_at", "failing_since"):
        op.drop_column("webhook_endpoints", column)
    op.drop_index(
        "ix_webhook_deliveries_endpoint_due",
        table_name="webhook_deliveries",
        postgresql_where=sa.text("state = 'pending'"),
    )
    op.drop_index(
        "ix_jobs_ingest_queue",
        table_name="jobs",
        postgresql_where=sa.text("state = 'validating' AND ingest_deferred"),
    )
    op.drop_column("jobs", "ingest_turn")
    op.drop_column("jobs", "ingest_attempts")
    op.drop_column("jobs", "ingest_deferred")
