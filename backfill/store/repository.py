"""The repository: one object over every part of the store, so callers keep one handle.

Each part (tenants, files, nodes, jobs, ingest, claims, item moves, recovery, stats) is a
:class:`~backfill.store.database.Store` of its own module; :class:`Repository` is all of them
on one pooled engine. Code that needs only one part may take that part's type instead.
"""

from __future__ import annotations

from backfill.store.files import Files
from backfill.store.ingest import Ingest
from backfill.store.ingest_queue import IngestQueue
from backfill.store.items import Items
from backfill.store.jobs import Jobs
from backfill.store.nodes import Nodes
from backfill.store.open_claims import OpenClaims
from backfill.store.prefixes import Prefixes
from backfill.store.recovery import Recovery
from backfill.store.retention import Retention
from backfill.store.stats import Stats
from backfill.store.summaries import Summaries
from backfill.store.tenants import Tenants


class Repository(
    Tenants,
    Files,
    Nodes,
    Jobs,
    Ingest,
    IngestQueue,
    OpenClaims,
    Items,
    Recovery,
    Stats,
    Retention,
    Summaries,
    Prefixes,
):
    """Postgres access for every Backfill process. Thread-safe (a pooled SQLAlchemy engine).

    ``fair_share`` is how :meth:`open_claim` orders tenants: by weighted fair share of the node
    (the default), or, when False, earliest deadline first across all tenants (the order
    before tenants were shared; kept to compare against).
    """
