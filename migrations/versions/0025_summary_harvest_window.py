"""a summarisation job's harvest reads the items that ended since its last round (issue 37)

The reduce driver's round read every ended item of the job's open batches, and every pending
step of the job, to find the steps whose item ended since the last round: O(batch) a round,
twice a second through a map wave, for a job whose batch has tens of thousands of lines. Now
a round reads the items of the job's open batches that ended in a window (from a little before
its last round's read: ``summary_jobs.harvest_mark``), by an index of the items' ends per job
(``ix_items_job_finished``), and the pending steps those items name by key; every
``FULL_READ_EVERY_S`` (and at a batch's end) it reads everything as before
(``summary_jobs.harvest_full_at``), so an end the window missed waits a minute, never more.

Revision ID: 0025_summary_harvest_window
Revises: 0024_webhook_endpoint_events
Create Date: 2026-12-07 20:40:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0025_summary_harvest_window"
down_revision: str | None = "0024_webhook_endpoint_events"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("summary_jobs", sa.Column("harvest_mark", sa.DateTime(timezone=True)))
    op.add_column("summary_jobs", sa.Column("harvest_full_at", sa.DateTime(timezone=True)))
    op.create_index(
        "ix_items_job_finished",
        "items",
        ["job_id", "finished_at"],
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index(
        "ix_items_job_finished",
        table_name="items",
        postgresql_where=sa.text("finished_at IS NOT NULL"),
    )
    op.drop_column("summary_jobs", "harvest_full_at")
    op.drop_column("summary_jobs", "harvest_mark")
