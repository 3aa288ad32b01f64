"""summarisation jobs: documents in, summaries out, steps run in the job's batches (issue 37)

A summarisation job holds its documents (one row each, with its summary or its error), the
steps each document makes (a map step per chunk, the reduce steps above them, keyed by
document and node so none is made twice), and the batches of the Batch API that carry them,
all under the job's one deadline.

Revision ID: 0014_summary_jobs
Revises: 0013_defaulted_output
Create Date: 2026-12-06 10:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_summary_jobs"
down_revision: str | None = "0013_defaulted_output"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TZ = sa.DateTime(timezone=True)
JOB_STATES = (
    "'cancelled', 'cancelling', 'completed', 'expired', 'failed', 'in_progress', 'receiving'"
)
ENDED = "'failed', 'pending', 'succeeded'"


def upgrade() -> None:
    op.create_table(
        "summary_jobs",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant_id", sa.String(40), nullable=False),
        sa.Column("model", sa.String(500), nullable=False),
        sa.Column("instruction", sa.Text(), nullable=False),
        sa.Column("completion_window", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), server_default="receiving", nullable=False),
        sa.Column("summary_tokens", sa.Integer(), nullable=False),
        sa.Column("context_tokens", sa.Integer(), nullable=False),
        sa.Column("map_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("reduce_prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("fan_in", sa.Integer(), nullable=False),
        sa.Column("forecast_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("planned_steps", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("deadline", TZ, nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.Column("started_at", TZ, nullable=True),
        sa.Column("ended_at", TZ, nullable=True),
        sa.CheckConstraint(f"state IN ({JOB_STATES})", name="ck_summary_jobs_state"),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name="fk_summary_jobs_tenant_id_tenants",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_summary_jobs"),
    )
    op.create_index("ix_summary_jobs_tenant_created", "summary_jobs", ["tenant_id", "created_at"])
    op.create_index(
        "ix_summary_jobs_open",
        "summary_jobs",
        ["created_at"],
        postgresql_where=sa.text("state IN ('in_progress', 'cancelling')"),
    )
    op.create_table(
        "summary_documents",
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("source_id", sa.String(512), nullable=True),
        sa.Column("state", sa.String(16), server_default="pending", nullable=False),
        sa.Column("chunks", sa.Integer(), server_default="1", nullable=False),
        sa.Column("split_depth", sa.Integer(), server_default="0", nullable=False),
        sa.Column("touched", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("summary", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), server_default="0", nullable=False),
        sa.CheckConstraint(f"state IN ({ENDED})", name="ck_summary_documents_state"),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["summary_jobs.id"],
            name="fk_summary_documents_job_id_summary_jobs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "seq", name="pk_summary_documents"),
    )
    op.create_index("ix_summary_documents_job_state", "summary_documents", ["job_id", "state"])
    op.create_index(
        "ix_summary_documents_touched",
        "summary_documents",
        ["job_id", "seq"],
        postgresql_where=sa.text("touched"),
    )
    op.create_table(
        "summary_steps",
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("node", sa.Integer(), nullable=False),
        sa.Column("body", sa.Text(), nullable=True),
        sa.Column("line_bytes", sa.Integer(), nullable=False),
        sa.Column("batch_no", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(16), server_default="pending", nullable=False),
        sa.Column("summary", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.Column("completion_tokens", sa.Integer(), server_default="0", nullable=False),
        sa.CheckConstraint(f"state IN ({ENDED})", name="ck_summary_steps_state"),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["summary_jobs.id"],
            name="fk_summary_steps_job_id_summary_jobs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "seq", "node", name="pk_summary_steps"),
    )
    op.create_index(
        "ix_summary_steps_unbatched",
        "summary_steps",
        ["job_id", "seq", "node"],
        postgresql_where=sa.text("batch_no IS NULL"),
    )
    op.create_index(
        "ix_summary_steps_pending",
        "summary_steps",
        ["job_id", "batch_no"],
        postgresql_where=sa.text("state = 'pending'"),
    )
    op.create_table(
        "summary_batches",
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("batch_no", sa.Integer(), nullable=False),
        sa.Column("batch_id", sa.String(40), nullable=True),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["summary_jobs.id"],
            name="fk_summary_batches_job_id_summary_jobs",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "batch_no", name="pk_summary_batches"),
    )


def downgrade() -> None:
    op.drop_table("summary_batches")
    op.drop_table("summary_steps")
    op.drop_table("summary_documents")
    op.drop_table("summary_jobs")
