"""The domain model in Postgres: the source of truth for jobs, items and attempts.

Redis holds the live token ledger, but everything needed to rebuild it lives here. States are
stored as text with a CHECK constraint built from the enums, so a value outside the state
machine cannot be written even by hand.

- ``base``: the declarative base, its naming convention, the enum lists of the CHECKs.
- ``jobs``: tenants, keys, files, nodes, jobs, items, attempts, events, the ledger's epoch.
- ``webhooks``: endpoints, the outbox of batch events, their deliveries.
- ``summaries``: summarisation jobs, their documents, steps and batches.

Importing this package puts every table on :data:`Base.metadata` (Alembic's
``migrations/env.py`` and the drift test compare the schema with it).
"""

from __future__ import annotations

from backfill.models import summaries, webhooks
from backfill.models.base import Base
from backfill.models.jobs import ACTIVE_SQL, CLAIMABLE_SQL, JOB_ENDED_AT

__all__ = ["ACTIVE_SQL", "CLAIMABLE_SQL", "JOB_ENDED_AT", "Base", "summaries", "webhooks"]
