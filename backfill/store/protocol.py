"""What each part of Backfill asks of the store: the roles it uses, no more.

:class:`~backfill.store.Repository` is the one implementation: it holds each role of the store
as an attribute (``repo.files``, ``repo.jobs``, ``repo.claims``, ...). A consumer takes a
protocol naming only the roles it calls, so what each part reads and writes in Postgres is
written down here, and mypy proves the repository has it where the concrete one is handed over
(``worker.node``, ``worker.tasks``, ``backfill.gateway.admission``, the API's routes). A caller
that needs other roles together says so the same way: a protocol with those attributes.

- :class:`AttemptStore`: a worker node's dispatcher, claiming items and writing what becomes
  of each attempt (``worker.dispatch*``).
- :class:`NodeRecords`: the gateway's node directory, reading the registered nodes.
- :class:`ItemPages`: the result renderer, reading a job's items page by page
  (``backfill.results``).
- :class:`JobMoves`: reading a job and moving it, on Postgres' clock; shared by the next two.
- :class:`BatchStore`: the API's batch and file side, storing uploads and creating batches
  (``backfill.batches``).
- :class:`JobLifecycle`: finalizing, cancelling, expiring and recovering jobs
  (``backfill.finalize``).
- :class:`QueueStats`: the scrape-time metrics, reading totals and token figures
  (``backfill.telemetry``).
- :class:`CapacityRecords`: the capacity view, reading nodes, live attempts and the backlog
  (``backfill.capacity_view``).
- :class:`MaintenanceStore`: the maintenance tick, which also rebuilds the ledger from the
  records of live attempts and reaps lost ones (``backfill.maintenance``).
- :class:`SummaryStore`: summarisation jobs (``backfill.summarize``).

Role attributes are read-only by use (the repository builds each once); they are declared as
plain attributes because that is what the repository has.
"""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from backfill.store.files import Files
from backfill.store.ingest import Ingest
from backfill.store.ingest_queue import IngestQueue
from backfill.store.items import Items
from backfill.store.jobs import Jobs
from backfill.store.nodes import Nodes
from backfill.store.open_claims import Claims
from backfill.store.recovery import Recovery
from backfill.store.retention import Retention
from backfill.store.stats import Stats
from backfill.store.summaries import SummaryBatches, SummaryJobs, SummaryOutcomes, SummaryReports
from backfill.store.tenants import Tenants


class AttemptStore(Protocol):
    """Claims and attempts, as a node's dispatcher writes them: an open claim and its start
    (or drop), heartbeat (``claims``), and the end of each attempt (``items``), every write
    fenced by its attempt (and lease)."""

    claims: Claims
    items: Items


class NodeRecords(Protocol):
    """The registered nodes (engines, pools, models served)."""

    nodes: Nodes


class QueueStats(NodeRecords, Protocol):
    """What the metrics read: items and jobs per state, the batch backlog, the token figures
    of the items that finished (``stats``), and the deferred creates waiting
    (``ingest_queue``)."""

    stats: Stats
    ingest_queue: IngestQueue


class CapacityRecords(NodeRecords, Protocol):
    """What the capacity view reads: the nodes, the attempts holding leases (``recovery``),
    the backlog (``stats``)."""

    recovery: Recovery
    stats: Stats


class ItemPages(Protocol):
    """A job's items in line order, a page at a time."""

    items: Items


class JobMoves(Protocol):
    """A job read and moved (guarded by its state), and Postgres' clock."""

    jobs: Jobs

    def now(self) -> datetime: ...


class BatchStore(JobMoves, ItemPages, Protocol):
    """The API's batch side: uploads and their pieces (``files``), a batch created and its
    items stored (``jobs``, ``ingest``), and what admission weighs (a tenant's stored items
    and bytes, the backlog, the models served)."""

    files: Files
    ingest: Ingest
    tenants: Tenants
    stats: Stats
    nodes: Nodes


class IngestStore(BatchStore, Protocol):
    """An ingest process's store: the batch side, and the queue of deferred creates."""

    ingest_queue: IngestQueue


class JobLifecycle(JobMoves, ItemPages, Protocol):
    """A job's late moves: finalized with its result files once every item finished,
    cancelled, expired at its deadline, failed when left validating."""

    files: Files


class MaintenanceStore(JobLifecycle, NodeRecords, Protocol):
    """The maintenance tick's store: the job lifecycle, the records a ledger rebuild and the
    reaper read (``recovery``), expired files, and the purge of ended jobs (``retention``)."""

    recovery: Recovery
    retention: Retention


class SummaryStore(BatchStore, JobLifecycle, Protocol):
    """Summarisation jobs: their documents, steps and batches (``backfill.store.summaries``),
    and the batch side and job moves their batches are made and cancelled with
    (``backfill.summarize.driver``, ``backfill.summarize.jobs``)."""

    summary_jobs: SummaryJobs
    summary_batches: SummaryBatches
    summary_outcomes: SummaryOutcomes
    summary_reports: SummaryReports
