"""tenant weights and the tenant of each item, for the fair-share claim (issue 17)

Revision ID: 0003_tenant_weights
Revises: 0002
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_tenant_weights"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CLAIMABLE = sa.text("state IN ('deferred', 'preempted', 'queued')")
ACTIVE = sa.text("state IN ('reserved', 'running')")


def upgrade() -> None:
    op.add_column("tenants", sa.Column("weight", sa.Double(), server_default="1", nullable=False))
    op.create_check_constraint(op.f("ck_tenants_weight_positive"), "tenants", "weight > 0")
    # Each item carries its job's tenant, so a claim takes a tenant's items by index alone.
    op.add_column("items", sa.Column("tenant_id", sa.String(length=40), nullable=True))
    op.execute("UPDATE items SET tenant_id = j.tenant_id FROM jobs j WHERE j.id = items.job_id")
    op.alter_column("items", "tenant_id", nullable=False)
    op.create_index(
        "ix_items_claim_tenant",
        "items",
        ["tenant_id", "deadline", "id"],
        unique=False,
        postgresql_where=CLAIMABLE,
    )
    op.create_index(
        "ix_items_node_active",
        "items",
        ["node", "tenant_id"],
        unique=False,
        postgresql_where=ACTIVE,
    )
    op.create_index(
        "ix_jobs_in_progress_tenant",
        "jobs",
        ["tenant_id"],
        unique=False,
        postgresql_where=sa.text("state = 'in_progress'"),
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_in_progress_tenant", table_name="jobs")
    op.drop_index("ix_items_node_active", table_name="items")
    op.drop_index("ix_items_claim_tenant", table_name="items")
    op.drop_column("items", "tenant_id")
    op.drop_constraint(op.f("ck_tenants_weight_positive"), "tenants", type_="check")
    op.drop_column("tenants", "weight")
