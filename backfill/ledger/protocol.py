"""What each kind of holder asks of the ledger: one protocol per role, no more than it calls.

:class:`~backfill.ledger.AsyncLedger` and :class:`~backfill.ledger.Ledger` are the only
implementations. Consumers take a role instead, so what each part of Backfill does to the
ledger is written down here, and mypy proves the ledger has it where the concrete ledger is
handed over (``worker.node``, ``backfill.gateway.admission``, ``worker.tasks``,
``queue_api.app``).

- :class:`LeaseUpkeep` (asyncio): what both of the next two do while they hold leases.
- :class:`BatchLedger` (asyncio): a worker node's dispatcher, reserving and settling the
  leases of the batch items it runs, heartbeating them, watching its pool.
- :class:`InteractiveLedger` (asyncio): the gateway, admitting one interactive request at a
  time and keeping its lease for as long as the request streams.
- :class:`SignalRedis` (asyncio): the ledger's Redis as the board the work signals are
  published on (``backfill.work_signals``), beside the ledger's keys.
- :class:`MaintenanceLedger`: the maintenance tick, rebuilding what Redis lost from Postgres
  and reclaiming the leases of lost attempts.
- :class:`LedgerReadings`: the metrics and the capacity view, reading pools and counters.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol

from backfill.errors import BackfillError
from backfill.keys import LedgerKeys
from backfill.ledger import values as lv
from backfill.ledger.listeners import AsyncChannelListener
from backfill.policy import ServiceClass
from backfill.redis_client import AsyncRedis, SyncRedis


class SignalRedis(Protocol):
    """The ledger's Redis, for the small keys kept beside the ledger: interactive signals,
    work budgets, the engine scheduler's figures, and Redis' clock."""

    @property
    def client(self) -> AsyncRedis: ...

    @property
    def keys(self) -> LedgerKeys: ...


class LeaseUpkeep(Protocol):
    """What a holder of leases does while it holds them, batch or interactive: heartbeat
    them and record their progress, a node at a time; close a node whose ledger lost one of
    them (Redis lost writes) until a rebuild; release one at the end."""

    async def heartbeat_many(
        self, node: str, held: Sequence[tuple[str, int]], *, ttl_ms: int | None = ...
    ) -> list[lv.HeartbeatResult | BackfillError]: ...

    async def settle_many(
        self, node: str, progress: Sequence[tuple[str, int, int]]
    ) -> list[lv.SettleResult]: ...

    async def mark_incomplete(self, node: str) -> bool: ...

    async def release(self, held: lv.HeldLease) -> lv.LeaseStatus: ...


class BatchLedger(SignalRedis, LeaseUpkeep, Protocol):
    """What a node's batch dispatcher asks of the ledger (``worker.dispatch*``): its pool's
    slack and the engine's use of it, many reservations and releases at once, and the
    notices of its leases' preemption."""

    async def snapshot(self, node: str) -> lv.PoolSnapshot | None: ...

    async def observe(
        self, node: str, observed_tokens: int, *, over_reserved_tokens: int | None = ...
    ) -> int | None: ...

    async def reserve_many(
        self, requests: Sequence[lv.ReserveRequest]
    ) -> list[lv.Lease | lv.Denial]: ...

    async def release_many(self, held: Sequence[lv.HeldLease]) -> list[lv.LeaseStatus]: ...

    async def release_unconfirmed(
        self, requests: Sequence[lv.ReserveRequest]
    ) -> list[lv.LeaseStatus]: ...

    async def listen_preemptions(self, node: str) -> AsyncChannelListener: ...

    async def listen_claimable(self) -> AsyncChannelListener: ...


class InteractiveLedger(LeaseUpkeep, Protocol):
    """What the gateway asks of the ledger for interactive requests (``backfill.gateway``):
    rank the nodes and reserve on one, shrink the reservation to what the request used, and
    put a lease Redis lost back once its node's rebuild has begun."""

    async def snapshot(self, node: str) -> lv.PoolSnapshot | None: ...

    async def reserve(
        self,
        node: str,
        service_class: ServiceClass,
        prompt_tokens: int,
        max_output_tokens: int,
        *,
        n: int = ...,
        lease_id: str | None = ...,
        owner: str = ...,
        allow_preemption: bool = ...,
        ttl_ms: int | None = ...,
        tenant_share_ppm: int | None = ...,
    ) -> lv.Lease | lv.Denial: ...

    async def settle(
        self,
        node: str,
        lease_id: str,
        fencing_token: int,
        generated_tokens: int,
        *,
        reservation_tokens: int | None = ...,
    ) -> lv.SettleResult: ...

    async def restore_lease(self, lease: lv.Lease, *, ttl_ms: int, now_ms: int) -> bool: ...


class MaintenanceLedger(Protocol):
    """What the maintenance tick asks of the ledger (``backfill.maintenance``): rebuild the
    nodes Redis lost from Postgres' records, tell holders of stopped items, reclaim leases."""

    def incomplete_nodes(self) -> frozenset[str] | None: ...

    def rebuild(
        self,
        nodes: Sequence[lv.NodePool],
        active_leases: Sequence[lv.ActiveLease],
        epoch: int,
        *,
        only: Collection[str] | None = ...,
    ) -> lv.RebuildReport: ...

    def preempt(
        self, node: str, tokens_needed: int, *, victims: Sequence[str] | None = ...
    ) -> lv.PreemptResult: ...

    def release_many(self, held: Sequence[lv.HeldLease]) -> list[lv.LeaseStatus]: ...

    def nodes(self) -> list[str]: ...

    def reap_many(self, nodes: Sequence[str]) -> list[list[str]]: ...


class LedgerReadings(Protocol):
    """What the metrics and the capacity view read of the ledger (``backfill.telemetry``,
    ``backfill.capacity_view``): pools, counters, and the work budgets kept beside them."""

    @property
    def client(self) -> SyncRedis: ...

    @property
    def keys(self) -> LedgerKeys: ...

    def nodes(self) -> list[str]: ...

    def snapshot(self, node: str) -> lv.PoolSnapshot | None: ...

    def counters(self, node: str) -> lv.PoolCounters: ...
