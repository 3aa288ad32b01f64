"""The repository: every role of the store over one connection source, so callers keep one
handle.

Each role (tenants, files, nodes, jobs, ingest, claims, item moves, recovery, stats, ...) is a
class of its own module over one :class:`~backfill.store.database.Database`; no role subclasses
another. :class:`Repository` builds each once on one pooled engine and holds them as
attributes: ``repo.files.create_file(...)``, ``repo.claims.open_claim(...)``. Code that needs
only some roles takes a protocol naming them (:mod:`~backfill.store.protocol`).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Self

from sqlalchemy import Engine, create_engine

from backfill.clock import HostClock
from backfill.store.database import Database
from backfill.store.files import Files
from backfill.store.ingest import Ingest
from backfill.store.ingest_queue import IngestQueue
from backfill.store.items import Items
from backfill.store.jobs import Jobs
from backfill.store.nodes import Nodes
from backfill.store.open_claims import Claims
from backfill.store.prefixes import Prefixes
from backfill.store.recovery import Recovery
from backfill.store.retention import Retention
from backfill.store.stats import Stats
from backfill.store.summaries import SummaryBatches, SummaryJobs, SummaryOutcomes, SummaryReports
from backfill.store.tenants import Tenants


class Repository:
    """Postgres access for every Backfill process, one role per attribute. Thread-safe (a
    pooled SQLAlchemy engine).

    ``fair_share`` is how :meth:`Claims.open_claim` orders tenants: by weighted fair share of
    the node (the default), or, when False, earliest deadline first across all tenants (the
    order before tenants were shared; kept to compare against).
    """

    def __init__(
        self, engine: Engine, *, fair_share: bool = True, host_clock: HostClock = time.time
    ) -> None:
        self.db = Database(engine, fair_share=fair_share, host_clock=host_clock)
        self.tenants = Tenants(self.db)
        """Tenants, their weights and API keys."""
        self.files = Files(self.db)
        """Uploads and result files, stored in pieces."""
        self.nodes = Nodes(self.db)
        """The registered nodes: engines, pools, models served."""
        self.jobs = Jobs(self.db)
        """Batch jobs: created, read, moved (guarded by their state) and swept."""
        self.ingest = Ingest(self.db)
        """A job's items stored (binary COPY) and their prompt tokens counted."""
        self.ingest_queue = IngestQueue(self.db)
        """Deferred creates, taken by the ingest processes."""
        self.claims = Claims(self.db)
        """The worker's claims: open, started or dropped, and their heartbeats."""
        self.items = Items(self.db)
        """What becomes of each attempt after its claim, and a job's items read."""
        self.recovery = Recovery(self.db)
        """The ledger rebuild's rows (live attempts, the next epoch) and the reaper."""
        self.stats = Stats(self.db)
        """Totals, the backlog and token figures, for metrics and admission."""
        self.retention = Retention(self.db)
        """Ended jobs purged in chunks."""
        self.prefixes = Prefixes(self.db)
        """The prefix pass: shared prompt prefixes found per job."""
        self.summary_jobs = SummaryJobs(self.db)
        """Summarisation jobs: created, their documents received, moved, driven."""
        self.summary_batches = SummaryBatches(self.db)
        """A summarisation job's steps cut into batches."""
        self.summary_outcomes = SummaryOutcomes(self.db)
        """The reduce driver's harvest of ended steps and the decisions it writes back."""
        self.summary_reports = SummaryReports(self.db)
        """A summarisation job's counts and its documents page by page."""

    @classmethod
    def connect(cls, database_url: str, *, pool_size: int = 5, fair_share: bool = True) -> Self:
        engine = create_engine(database_url, pool_size=pool_size, max_overflow=pool_size)
        return cls(engine, fair_share=fair_share)

    @property
    def engine(self) -> Engine:
        return self.db.engine

    @property
    def fair_share(self) -> bool:
        return self.db.fair_share

    def now(self) -> datetime:
        """The time on Postgres' clock (see :meth:`Database.now`)."""
        return self.db.now()

    def ping(self) -> None:
        self.db.ping()

    def close(self) -> None:
        self.db.close()
