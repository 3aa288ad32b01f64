"""The capacity view: per node, the pool and who holds it; plus the queued work per class.

Postgres knows each node's measured pool, its interactive reserve, and the batch tokens held
by live attempts. The live ledger in Redis knows more (interactive in use, exact slack); a
:data:`UsageSource` supplies that when the ledger is wired in, and the view says which source
each figure came from.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from backfill.engine_scheduler import EngineScheduler, read_scheduler
from backfill.errors import BackfillError
from backfill.ledger import LedgerReadings
from backfill.store import CapacityRecords, NodeRecord
from backfill.work_signals import BudgetView, read_budget


@dataclass(frozen=True, slots=True)
class LedgerUsage:
    """What the ledger holds for one node right now."""

    interactive_in_use: int
    batch_in_use: int
    batch_slack: int
    work_budget: BudgetView | None = None
    """The node's batch work budget as its worker last published it."""
    engine_scheduler: EngineScheduler | None = None
    """The node's engine step scheduler as its worker last read it (None: vLLM's own)."""


UsageSource = Callable[[NodeRecord], LedgerUsage | None]
"""Reads one node's live usage from the ledger; None when the ledger has no pool for it."""


def ledger_usage(ledger: LedgerReadings) -> UsageSource:
    """A :data:`UsageSource` over the live ledger. A node the ledger has no pool for, or a
    ledger that cannot answer now (Redis down, rebuilding), falls back to Postgres's view
    rather than failing the whole capacity read."""

    def read(node: NodeRecord) -> LedgerUsage | None:
        try:
            snap = ledger.snapshot(node.name)
        except (BackfillError, ValueError):
            return None
        if snap is None:
            return None
        budget: BudgetView | None = None
        scheduler: EngineScheduler | None = None
        # Budget and scheduler are for people and dashboards: without them the capacity view
        # still stands.
        with contextlib.suppress(Exception):
            budget = read_budget(ledger.client, ledger.keys, node.name)
        with contextlib.suppress(Exception):
            scheduler = read_scheduler(ledger.client, ledger.keys, node.name)
        return LedgerUsage(
            snap.interactive_in_use, snap.batch_in_use, snap.slack, budget, scheduler
        )

    return read


@dataclass(frozen=True, slots=True)
class NodeCapacity:
    name: str
    model: str | None
    engine_url: str
    num_blocks: int
    block_size: int
    capacity_tokens: int
    interactive_reserve_tokens: int
    batch_reserved_tokens: int
    """Reservations of live batch attempts as Postgres records them."""
    interactive_in_use: int | None
    batch_in_use: int | None
    slack_tokens: int
    source: str
    """``"ledger"`` or ``"postgres"`` (no live interactive figure: slack ignores it)."""
    last_seen_at: datetime
    work_budget: BudgetView | None = None
    engine_scheduler: EngineScheduler | None = None
    endpoints: tuple[str, ...] | None = None
    """The batch endpoints its engine serves; None: not known."""


@dataclass(frozen=True, slots=True)
class ModelPool:
    """The nodes that serve one model, summed: batch of that model runs only there."""

    nodes: tuple[str, ...]
    capacity_tokens: int
    slack_tokens: int
    batch_in_use: int
    interactive_in_use: int
    endpoints: tuple[str, ...] | None = None
    """The batch endpoints those nodes serve; None if one of them did not say."""


@dataclass(frozen=True, slots=True)
class CapacityReport:
    nodes: list[NodeCapacity]
    queued_tokens: dict[str, int]
    """Worst-case tokens of unfinished work per service class."""

    @property
    def models(self) -> dict[str, ModelPool]:
        """The pools per served model (nodes whose engine serves no known model are left out)."""
        by_model: dict[str, list[NodeCapacity]] = defaultdict(list)
        for node in self.nodes:
            if node.model is not None:
                by_model[node.model].append(node)
        return {
            model: ModelPool(
                nodes=tuple(n.name for n in nodes),
                capacity_tokens=sum(n.capacity_tokens for n in nodes),
                slack_tokens=sum(n.slack_tokens for n in nodes),
                batch_in_use=sum(
                    n.batch_reserved_tokens if n.batch_in_use is None else n.batch_in_use
                    for n in nodes
                ),
                interactive_in_use=sum(n.interactive_in_use or 0 for n in nodes),
                endpoints=_endpoints(nodes),
            )
            for model, nodes in sorted(by_model.items())
        }


def _endpoints(nodes: list[NodeCapacity]) -> tuple[str, ...] | None:
    if any(n.endpoints is None for n in nodes):
        return None
    return tuple(sorted({e for n in nodes for e in n.endpoints or ()}))


def capacity_report(repo: CapacityRecords, usage: UsageSource | None = None) -> CapacityReport:
    held: dict[str, int] = defaultdict(int)
    for lease in repo.recovery.active_leases():
        held[lease.node] += lease.reservation_tokens or 0
    nodes = []
    for node in repo.nodes.nodes():
        live = usage(node) if usage is not None else None
        capacity = node.capacity_tokens
        if live is not None:
            slack, source = live.batch_slack, "ledger"
        else:
            slack = max(0, capacity - node.interactive_reserve_tokens - held[node.name])
            source = "postgres"
        nodes.append(
            NodeCapacity(
                name=node.name,
                model=node.model,
                engine_url=node.engine_url,
                num_blocks=node.num_blocks,
                block_size=node.block_size,
                capacity_tokens=capacity,
                interactive_reserve_tokens=node.interactive_reserve_tokens,
                batch_reserved_tokens=held[node.name],
                interactive_in_use=live.interactive_in_use if live else None,
                batch_in_use=live.batch_in_use if live else None,
                slack_tokens=slack,
                source=source,
                last_seen_at=node.last_seen_at,
                work_budget=live.work_budget if live else None,
                engine_scheduler=live.engine_scheduler if live else None,
                endpoints=node.endpoints,
            )
        )
    # Interactive requests are never queued in Postgres: the gateway admits or refuses them.
    return CapacityReport(
        nodes=nodes, queued_tokens={"batch": repo.stats.backlog_tokens(), "interactive": 0}
    )
