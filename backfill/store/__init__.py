"""The store: the gateway for SQL. Every statement Backfill sends to Postgres about tenants,
files, nodes, jobs and items is in this package, each a named query beside the code that runs
it. The other modules that send SQL are the webhooks' (``backfill.webhooks.outbox`` and
``backfill.webhooks.store``): they own the ``webhook_*`` tables, the sender claims deliveries
in the outbox, and its ``enqueue_batch_event`` is called by :mod:`~backfill.store.jobs`
inside a job move's own transaction (``backfill.webhooks.doorbell`` only LISTENs for it).

Rules it keeps:
- Every state change is a guarded ``UPDATE ... WHERE state = ANY(sources)`` checked against
  ``backfill.states``; writes of a worker attempt also name the attempt number (and, once the
  item runs, the ledger's fencing token), so a stale attempt's late write matches no row.
  A single-item write that matches no row raises ``StaleWrite``; batch writes return the ids
  that applied.
- Per-job counters change in the same transaction as the items they count, and counter rows
  are always locked last and in job-id order, so concurrent writers cannot deadlock on them.
- Hot paths move rows in batches: COPY for ingest, ``FOR UPDATE SKIP LOCKED`` claims of many
  items at once, array-parameter updates for results; the claim path's statements (open
  claim, start, finish) skip SQLAlchemy (``driver``).
- Claims share each node between tenants by weight (``backfill.fairshare`` decides, the claim
  statement carries the plan out), earliest deadline first within a tenant.

Where things are: :mod:`~backfill.store.records` (the values it returns),
:mod:`~backfill.store.database` (the connection source every role shares: pool,
transactions, error translation, Postgres' clock),
:mod:`~backfill.store.tenants`, :mod:`~backfill.store.files`, :mod:`~backfill.store.nodes`,
:mod:`~backfill.store.jobs`, :mod:`~backfill.store.ingest`,
:mod:`~backfill.store.ingest_queue` (deferred creates, taken by the ingest processes),
:mod:`~backfill.store.claims` (the claim's pick and plan, in fair share order),
:mod:`~backfill.store.open_claims` (the claims role: a pick kept open, then one statement
that starts or holds; heartbeats), :mod:`~backfill.store.driver` (the hot path's statements as raw
prepared psycopg calls), :mod:`~backfill.store.items` (moves after a claim),
:mod:`~backfill.store.moves` (the guarded single-item move), :mod:`~backfill.store.counters`,
:mod:`~backfill.store.recovery` (ledger rebuild rows, the reaper), :mod:`~backfill.store.stats`,
and :class:`~backfill.store.repository.Repository`, which builds each role once over one
:class:`~backfill.store.database.Database` and holds it as an attribute (``repo.files``,
``repo.claims``, ...); consumers take a protocol naming the roles they use
(:mod:`~backfill.store.protocol`: :class:`AttemptStore`, :class:`BatchStore`, ...), not the
whole repository.
"""

from backfill.store.counters import COUNTED_STATES, COUNTER_SHARDS
from backfill.store.database import Database, ensure_database
from backfill.store.files import FILE_CHUNK_BYTES
from backfill.store.ingest_queue import IngestTake
from backfill.store.open_claims import OpenClaim
from backfill.store.protocol import (
    AttemptStore,
    BatchStore,
    CapacityRecords,
    IngestStore,
    ItemPages,
    JobLifecycle,
    JobMoves,
    MaintenanceStore,
    NodeRecords,
    QueueStats,
    SummaryStore,
)
from backfill.store.records import (
    ActiveLeaseRow,
    ApiKeyRecord,
    ClaimedItem,
    FilePage,
    FileRecord,
    Finish,
    FinishedTokenStats,
    ItemRecord,
    JobCounts,
    JobRecord,
    LostItem,
    NewItem,
    NodeRecord,
    RevokedKey,
    Start,
    TenantRecord,
)
from backfill.store.repository import Repository
from backfill.store.tenants import KEY_ID_CHARS, key_digest, key_id

__all__ = [
    "COUNTED_STATES",
    "COUNTER_SHARDS",
    "FILE_CHUNK_BYTES",
    "KEY_ID_CHARS",
    "ActiveLeaseRow",
    "ApiKeyRecord",
    "AttemptStore",
    "BatchStore",
    "CapacityRecords",
    "ClaimedItem",
    "Database",
    "FilePage",
    "FileRecord",
    "Finish",
    "FinishedTokenStats",
    "IngestStore",
    "IngestTake",
    "ItemPages",
    "ItemRecord",
    "JobCounts",
    "JobLifecycle",
    "JobMoves",
    "JobRecord",
    "LostItem",
    "MaintenanceStore",
    "NewItem",
    "NodeRecord",
    "NodeRecords",
    "OpenClaim",
    "QueueStats",
    "Repository",
    "RevokedKey",
    "Start",
    "SummaryStore",
    "TenantRecord",
    "ensure_database",
    "key_digest",
    "key_id",
]
