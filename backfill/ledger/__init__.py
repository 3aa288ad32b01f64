"""The KV-token ledger: one interface over the Lua scripts in ``backfill/lua/``.

Every change to the live ledger is one script call, atomic in Redis. The package builds each
call's KEYS and ARGV (:mod:`~backfill.ledger.calls`), writes each operation once as a plan of
steps (:mod:`~backfill.ledger.operations`, :mod:`~backfill.ledger.rebuild`), and runs the
plans over a synchronous client (:class:`Ledger`) or an asyncio one (:class:`AsyncLedger`),
both bound once in :mod:`~backfill.ledger.binding`, turning replies into typed values
(:mod:`~backfill.ledger.values`). Consumers take the role they play
(:mod:`~backfill.ledger.protocol`: :class:`BatchLedger`, :class:`InteractiveLedger`, ...),
not the classes. Redis errors become :class:`~backfill.errors.LedgerUnavailable`, script
refusals :class:`~backfill.errors.LedgerError`, in the ledgers and nowhere else.

Holders use leases in ``try/finally``: reserve, do the work, release. ``reserve`` is
idempotent per lease id, so after a connection error a retry with the same id cannot take the
tokens twice. Preemption reaches a holder twice: as a pub/sub notice
(:meth:`Ledger.listen_preemptions`), and, should the notice be lost, as the status of its next
heartbeat.

Redis is not durable. When it loses its data the ready marker is gone with it, batch admission
closes (denial reason ``ledger_rebuilding``), and :meth:`Ledger.rebuild` restores the pools and
live batch leases from records read from Postgres, then reopens admission.
"""

from backfill.ledger.async_ledger import AsyncLedger
from backfill.ledger.listeners import AsyncChannelListener, ChannelListener
from backfill.ledger.protocol import (
    BatchLedger,
    InteractiveLedger,
    LedgerReadings,
    MaintenanceLedger,
    SignalRedis,
)
from backfill.ledger.scripts import SCRIPTS, script_source
from backfill.ledger.sync_ledger import Ledger
from backfill.ledger.values import (
    ActiveLease,
    Denial,
    HeartbeatResult,
    HeldLease,
    Lease,
    LeaseRef,
    LeaseStatus,
    NodePool,
    PartialBatchError,
    PoolCounters,
    PoolSnapshot,
    PreemptResult,
    RebuildReport,
    ReserveRequest,
    SettleResult,
)

__all__ = [
    "SCRIPTS",
    "ActiveLease",
    "AsyncChannelListener",
    "AsyncLedger",
    "BatchLedger",
    "ChannelListener",
    "Denial",
    "HeartbeatResult",
    "HeldLease",
    "InteractiveLedger",
    "Lease",
    "LeaseRef",
    "LeaseStatus",
    "Ledger",
    "LedgerReadings",
    "MaintenanceLedger",
    "NodePool",
    "PartialBatchError",
    "PoolCounters",
    "PoolSnapshot",
    "PreemptResult",
    "RebuildReport",
    "ReserveRequest",
    "SettleResult",
    "SignalRedis",
    "script_source",
]
