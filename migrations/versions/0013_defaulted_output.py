"""items remember whether their line gave an output budget (issue 35)

A batch line without ``max_tokens`` (``max_completion_tokens``; ``max_output_tokens`` on
``/v1/responses``) is no longer refused for a prompt that leaves less than
``BACKFILL_BATCH_DEFAULT_MAX_TOKENS``: it gets what the class limit and the model's context
leave, at most the default, as OpenAI and vLLM give a request without one. Ingest reserves the
default or what the prompt's lower bound leaves; the worker, which knows the exact prompt,
sends the engine no more than what is left of it. ``output_defaulted`` marks the items whose
budget is Backfill's to fit, not the caller's; items stored before keep the budget written
into their bodies.

Revision ID: 0013_defaulted_output
Revises: 0012_sealed_secrets
Create Date: 2026-12-06 07:30:00.000000
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_defaulted_output"
down_revision: str | None = "0012_sealed_secrets"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "items",
        sa.Column("output_defaulted", sa.Boolean(), server_default=sa.false(), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("items", "output_defaulted")
