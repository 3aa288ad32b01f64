"""The work budget's signals and its published state, through Redis.

Two small hashes per node (key names in ``backfill.keys``):

``work:signals:{node}``
    Each gateway process writes one field (its id) with what it sees of interactive traffic on
    that node: requests waiting for admission, requests admitted but without a first token
    (in prefill), the arrival of the oldest of those, and the TTFTs of the last
    ``ttft_window_s``. Entries carry their write time and the key a short TTL, so a gateway
    that dies stops counting within ``ttl_s``; the worker sums the fresh entries.
``work:batch:{node}``
    Each worker process of the node writes one field (its id): how many of its batch
    sequences await their first token. The engine's waiting queue is shared by every worker
    on the node, so a worker must not read another worker's queued batch as interactive
    traffic; it subtracts the fresh entries of the others too.
``work:budget:{node}``
    Each worker process of the node writes one field (its id): its budget, what batch uses of
    it, why it last changed, and until when the entry counts. ``/v1/capacity`` and
    ``/metrics`` (the API process cannot see the workers' memory) show the node's sum of the
    fresh entries: every worker on a node runs its own budget against the same engine.

Times are seconds on Redis' clock (``backfill.clock.SharedClock``): writer and reader are
different processes, often on different hosts, whose own clocks may disagree by far more than
the entries' few seconds of freshness.
A request waiting for admission counts on every node it may be admitted to: it is pressure on
each of them until one admits it.
"""

from __future__ import annotations

import json
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.asyncio
import redis.cluster

from backfill.config import Settings
from backfill.keys import LedgerKeys
from backfill.redis_client import AsyncRedis, SyncRedis
from backfill.work_budget import BudgetReason, WorkBudget, WorkBudgetPolicy

Clock = Callable[[], float]


def work_budget_policy(settings: Settings, max_in_flight: int | None = None) -> WorkBudgetPolicy:
    """The controller's parameters from settings; the sequence ceiling never exceeds the
    worker's own in-flight cap."""
    ceiling = settings.work_budget_ceiling_seqs
    if max_in_flight is not None:
        ceiling = min(ceiling, max_in_flight)
    return WorkBudgetPolicy(
        ttft_target_s=settings.interactive_ttft_target_s,
        floor_seqs=min(settings.work_budget_floor_seqs, ceiling),
        ceiling_seqs=ceiling,
        floor_prefill_tokens=settings.work_budget_floor_prefill_tokens,
        ceiling_prefill_tokens=settings.work_budget_ceiling_prefill_tokens,
        decrease_factor=settings.work_budget_decrease_factor,
        increase_seqs=settings.work_budget_increase_seqs,
        increase_prefill_tokens=settings.work_budget_increase_prefill_tokens,
        quiet_s=settings.work_budget_quiet_s,
        preempt_at_fraction=settings.work_budget_preempt_at_fraction,
    )


# ---------------------------------------------------------------------------------------------
# Gateway side: what one process sees


@dataclass(frozen=True)
class InteractiveSignals:
    """Interactive traffic on one node, as gateways see it."""

    waiting: int = 0
    prefilling: int = 0
    oldest_pending_since_s: float | None = None
    ttfts: tuple[tuple[float, float], ...] = ()
    """``(first token at, TTFT)`` pairs, oldest first."""

    def to_json(self, at_s: float) -> str:
        return json.dumps(
            {
                "w": self.waiting,
                "p": self.prefilling,
                "o": self.oldest_pending_since_s,
                "t": [list(x) for x in self.ttfts],
                "at": at_s,
            },
            separators=(",", ":"),
        )


def merge_signals(
    raw: Mapping[bytes | str, bytes | str], now_s: float, ttl_s: float
) -> InteractiveSignals:
    """The sum of the fresh entries of a ``work:signals`` hash (stale or malformed ones are
    dropped: a dead gateway must not hold batch back)."""
    waiting = prefilling = 0
    oldest: float | None = None
    ttfts: list[tuple[float, float]] = []
    for value in raw.values():
        try:
            entry: dict[str, Any] = json.loads(value)
            at = float(entry["at"])
            if not math.isfinite(at) or now_s - at > ttl_s:
                continue
            waiting += max(0, int(entry.get("w", 0)))
            prefilling += max(0, int(entry.get("p", 0)))
            since = entry.get("o")
            if since is not None:
                oldest = float(since) if oldest is None else min(oldest, float(since))
            ttfts.extend((float(a), float(t)) for a, t in entry.get("t", ()))
        except (ValueError, TypeError, KeyError):
            continue
    ttfts.sort()
    return InteractiveSignals(waiting, prefilling, oldest, tuple(ttfts))


class PendingInteractive:
    """One interactive request from arrival to first token, as the tracker counts it."""

    __slots__ = ("_activity", "admitted_to", "arrived_s", "done", "nodes")

    def __init__(self, activity: InteractiveActivity, nodes: Iterable[str], arrived_s: float):
        self._activity = activity
        self.nodes = tuple(nodes)
        self.arrived_s = arrived_s
        self.admitted_to: str | None = None
        self.done = False

    def admitted(self, node: str) -> None:
        """Waiting for admission is over; prefill on ``node`` begins."""
        if not self.done:
            self.admitted_to = node
            self._activity.changed()

    def first_token(self, ttft_s: float) -> None:
        """The first token reached the caller: no longer pending; record the TTFT."""
        if self.done:
            return
        node = self.admitted_to
        self.end()
        if node is not None:
            self._activity.record_ttft(node, ttft_s)

    def end(self) -> None:
        """Refused, failed, disconnected or finished without a token: stop counting it."""
        if not self.done:
            self.done = True
            self._activity.forget(self)


@dataclass
class InteractiveActivity:
    """One gateway process's interactive requests per node (in memory; published by
    :func:`publish_signals`). Not thread-safe: it lives on the API's event loop."""

    ttft_window_s: float = 10.0
    max_ttfts: int = 64
    clock: Clock = time.time
    _pending: set[PendingInteractive] = field(default_factory=set)
    _ttfts: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    _known: dict[str, float] = field(default_factory=dict)
    """Nodes seen lately and when: each keeps being published (as zeros) for a while after
    its last request, so a reader sees the wave end rather than a stale entry expire."""
    version: int = 0

    def arrived(self, nodes: Iterable[str]) -> PendingInteractive:
        pending = PendingInteractive(self, nodes, self.clock())
        self._pending.add(pending)
        for node in pending.nodes:
            self._known[node] = pending.arrived_s
        self.changed()
        return pending

    def changed(self) -> None:
        self.version += 1

    def forget(self, pending: PendingInteractive) -> None:
        self._pending.discard(pending)
        self.changed()

    def record_ttft(self, node: str, ttft_s: float) -> None:
        window = self._ttfts.setdefault(node, deque(maxlen=self.max_ttfts))
        window.append((self.clock(), ttft_s))
        self.changed()

    def snapshot(self, keep_s: float) -> dict[str, InteractiveSignals]:
        """Per node, what to publish now; nodes idle for ``keep_s`` drop out."""
        now = self.clock()
        waiting: dict[str, int] = {}
        prefilling: dict[str, int] = {}
        oldest: dict[str, float] = {}
        for p in self._pending:
            nodes = (p.admitted_to,) if p.admitted_to is not None else p.nodes
            into = prefilling if p.admitted_to is not None else waiting
            for node in nodes:
                into[node] = into.get(node, 0) + 1
                oldest[node] = min(oldest.get(node, p.arrived_s), p.arrived_s)
                self._known[node] = now
        out: dict[str, InteractiveSignals] = {}
        for node, ttfts in self._ttfts.items():
            while ttfts and now - ttfts[0][0] > self.ttft_window_s:
                ttfts.popleft()
            if ttfts:
                self._known[node] = max(self._known.get(node, 0.0), ttfts[-1][0])
        for node, seen in list(self._known.items()):
            if now - seen > keep_s:
                del self._known[node]
                self._ttfts.pop(node, None)
                continue
            out[node] = InteractiveSignals(
                waiting.get(node, 0),
                prefilling.get(node, 0),
                oldest.get(node),
                tuple(self._ttfts.get(node, ())),
            )
        return out


async def publish_signals(
    client: AsyncRedis,
    keys: LedgerKeys,
    gateway_id: str,
    signals: Mapping[str, InteractiveSignals],
    ttl_s: float,
    now_s: float,
) -> None:
    if not signals:
        return
    ttl_ms = max(1, int(ttl_s * 1000))
    async with client.pipeline(transaction=False) as pipe:
        for node, s in signals.items():
            key = keys.work_signals(node)
            pipe.hset(key, gateway_id, s.to_json(now_s))
            pipe.pexpire(key, ttl_ms)
        await pipe.execute()


async def read_signals(
    client: AsyncRedis, keys: LedgerKeys, node: str, ttl_s: float, now_s: float
) -> InteractiveSignals:
    raw = await client.hgetall(keys.work_signals(node))
    return merge_signals(raw, now_s, ttl_s)


# ---------------------------------------------------------------------------------------------
# Worker side: batch of the other workers of a node


def merge_batch_awaiting(
    raw: Mapping[bytes | str, bytes | str], own_id: str, now_s: float, ttl_s: float
) -> int:
    """Batch sequences awaiting a first token on the node's *other* workers (fresh, well-formed
    entries only: a dead worker's count must not hide interactive traffic for long)."""
    total = 0
    for key, value in raw.items():
        worker = key.decode() if isinstance(key, bytes) else key
        if worker == own_id:
            continue
        try:
            entry: dict[str, Any] = json.loads(value)
            at = float(entry["at"])
            if not math.isfinite(at) or now_s - at > ttl_s:
                continue
            total += max(0, int(entry["a"]))
        except (ValueError, TypeError, KeyError):
            continue
    return total


async def exchange_batch_awaiting(
    client: AsyncRedis,
    keys: LedgerKeys,
    node: str,
    worker_id: str,
    awaiting: int,
    ttl_s: float,
    now_s: float,
) -> int:
    """Publish this worker's batch awaiting a first token; return the other workers' sum."""
    key = keys.work_batch(node)
    async with client.pipeline(transaction=False) as pipe:
        pipe.hset(key, worker_id, json.dumps({"a": awaiting, "at": now_s}))
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        pipe.hgetall(key)
        results = await pipe.execute()
    return merge_batch_awaiting(results[2], worker_id, now_s, ttl_s)


# ---------------------------------------------------------------------------------------------
# Worker side: the budget as published


@dataclass(frozen=True)
class BudgetView:
    """A node's work budget as ``/v1/capacity`` and ``/metrics`` show it."""

    max_seqs: int
    max_prefill_tokens: int
    hold: bool
    code: str
    reason: str
    changed_at_s: float
    in_flight: int
    prefill_tokens: int
    at_s: float
    workers: int = 1
    """How many workers' budgets this view sums (one, as a worker publishes it)."""

    @classmethod
    def of(cls, budget: WorkBudget, in_flight: int, prefill_tokens: int, at_s: float) -> BudgetView:
        return cls(
            budget.max_seqs,
            budget.max_prefill_tokens,
            budget.hold,
            str(budget.code),
            budget.reason,
            budget.changed_at_s,
            in_flight,
            prefill_tokens,
            at_s,
        )

    def to_mapping(self) -> dict[str, str]:
        return {
            "max_seqs": str(self.max_seqs),
            "max_prefill_tokens": str(self.max_prefill_tokens),
            "hold": "1" if self.hold else "0",
            "code": self.code,
            "reason": self.reason,
            "changed_at": repr(self.changed_at_s),
            "in_flight": str(self.in_flight),
            "prefill_tokens": str(self.prefill_tokens),
            "at": repr(self.at_s),
            "workers": str(self.workers),
        }

    @classmethod
    def from_mapping(cls, raw: Mapping[bytes, bytes] | Mapping[str, str]) -> BudgetView | None:
        d = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        try:
            return cls(
                int(d["max_seqs"]),
                int(d["max_prefill_tokens"]),
                d.get("hold") == "1",
                BudgetReason(d["code"]).value,
                d.get("reason", ""),
                float(d["changed_at"]),
                int(d.get("in_flight", "0")),
                int(d.get("prefill_tokens", "0")),
                float(d["at"]),
                int(d.get("workers", "1")),
            )
        except (KeyError, ValueError):
            return None


def merge_budgets(views: Iterable[BudgetView]) -> BudgetView | None:
    """The node's budget from its workers' (each runs its own against the same engine): limits
    and use add up; batch is held when any worker holds it; the reason is the latest change's.
    None without a view."""
    views = list(views)
    if not views:
        return None
    if len(views) == 1:
        return views[0]
    latest = max(views, key=lambda v: v.changed_at_s)
    return BudgetView(
        sum(v.max_seqs for v in views),
        sum(v.max_prefill_tokens for v in views),
        any(v.hold for v in views),
        latest.code,
        latest.reason,
        latest.changed_at_s,
        sum(v.in_flight for v in views),
        sum(v.prefill_tokens for v in views),
        max(v.at_s for v in views),
        sum(v.workers for v in views),
    )


def fresh_budgets(raw: Mapping[bytes, bytes] | Mapping[str, str], now_s: float) -> list[BudgetView]:
    """The workers' entries of a ``work:budget:{node}`` hash that still count at ``now_s``
    (each carries its own ``expires``); unreadable entries are skipped."""
    out: list[BudgetView] = []
    for value in raw.values():
        try:
            d = json.loads(value)
            if float(d.pop("expires")) < now_s:
                continue
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
        view = BudgetView.from_mapping({str(k): str(v) for k, v in d.items()})
        if view is not None:
            out.append(view)
    return out


async def publish_budget(
    client: AsyncRedis,
    keys: LedgerKeys,
    node: str,
    worker_id: str,
    view: BudgetView,
    ttl_s: float,
) -> None:
    """Write this worker's entry; it counts for ``ttl_s`` unless written again (a worker that
    dies stops counting), and the whole hash goes when no worker writes for that long."""
    key = keys.work_budget(node)
    entry = json.dumps(view.to_mapping() | {"expires": repr(view.at_s + ttl_s)})
    async with client.pipeline(transaction=False) as pipe:
        pipe.hset(key, worker_id, entry)
        pipe.pexpire(key, max(1, int(ttl_s * 1000)))
        await pipe.execute()


def read_budget(
    client: SyncRedis, keys: LedgerKeys, node: str, now_s: float | None = None
) -> BudgetView | None:
    """The node's budget, summed over its workers' fresh entries (judged at ``now_s``, by
    default Redis' clock, read in the same round trip); None when no worker with a budget
    runs there."""
    if isinstance(client, redis.cluster.RedisCluster):
        # A cluster pipeline takes no TIME (it has no key to route by): two calls.
        raw: Any = client.hgetall(keys.work_budget(node))
        secs, micros = client.time() if now_s is None else (0, 0)
    else:
        with client.pipeline(transaction=False) as pipe:
            pipe.hgetall(keys.work_budget(node))
            pipe.time()
            raw, (secs, micros) = pipe.execute()
    now = int(secs) + int(micros) / 1_000_000 if now_s is None else now_s
    return merge_budgets(fresh_budgets(raw, now))
