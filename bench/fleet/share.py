"""One harness process's share of the fleet: its nodes as asyncio tasks over one pooled
Repository and one Redis pool (Backfill's plane or the raw floor), measured over the same
wall-clock window as the other processes'.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from backfill.config import get_settings, libpq_url
from backfill.keys import LedgerKeys
from backfill.ledger import AsyncLedger, Ledger
from backfill.maintenance import pool_policy
from backfill.redis_client import AsyncRedis, SyncRedis, connect, connect_async, is_cluster_url
from backfill.store import Repository
from backfill.work_signals import work_budget_policy
from bench.fleet.model import h100_node
from bench.fleet.node import Recorder, SimNode, cancel_all
from bench.fleet.plane import BackfillPlane, NodeConfig, Plane
from bench.fleet.point import OUTPUT_TOKENS
from bench.fleet.raw_plane import RawPlane
from bench.fleet.stats import process_cpu_s

THREADS_PER_PROC = 48


@dataclass(frozen=True)
class Share:
    side: str
    url: str
    redis_url: str
    namespace: str
    nodes: tuple[str, ...]
    cfg: NodeConfig
    measure_from: float
    measure_until: float
    """Wall-clock times (time.time) of the measured window, the same for every process."""


def child(share: Share, out: Any) -> None:
    delivered = False

    def deliver(result: dict[str, Any]) -> None:
        nonlocal delivered
        out.put(result)
        delivered = True

    try:
        asyncio.run(_serve(share, deliver))
    except BaseException as exc:  # the parent must hear of it, not wait forever
        if not delivered:
            out.put({"error": repr(exc)})
        raise


async def _serve(share: Share, deliver: Callable[[dict[str, Any]], None]) -> None:
    """Run the share's nodes; ``deliver`` the window's figures as soon as it closes, before
    the teardown (a thread still inside a call can hold the teardown up; the parent then ends
    this process once it has the figures)."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(THREADS_PER_PROC))
    settings = get_settings()
    policy = pool_policy(settings)
    client: AsyncRedis
    listen_client: AsyncRedis
    if is_cluster_url(share.redis_url):
        if share.side == "raw":
            raise ValueError("the raw floor runs on one Redis server, not a cluster")
        # The cluster client keeps a pool per shard and follows the slot map itself; it fails
        # a call when a pool is full rather than waiting (MaxConnectionsError), so no cap here.
        client = connect_async(share.redis_url)
        listen_client = connect_async(share.redis_url)
        claim_client: SyncRedis = connect(share.redis_url)
    else:
        client = redis.asyncio.Redis(
            connection_pool=redis.asyncio.BlockingConnectionPool.from_url(
                share.redis_url, max_connections=64, timeout=30
            )
        )
        # Each node's preemption subscription holds a connection of its own.
        listen_client = redis.asyncio.Redis.from_url(share.redis_url)
        # The claims' windows, one thread each (at most the open-claim slots at once).
        claim_client = redis.Redis(
            connection_pool=redis.BlockingConnectionPool.from_url(
                share.redis_url, max_connections=THREADS_PER_PROC, timeout=30
            )
        )
    keys = LedgerKeys(share.namespace)
    plane: Plane
    repo: Repository | None = None
    raw: RawPlane | None = None
    if share.side == "raw":
        assert isinstance(client, redis.asyncio.Redis)  # one server (refused above otherwise)
        assert isinstance(listen_client, redis.asyncio.Redis)
        raw = RawPlane(libpq_url(share.url), client, keys, THREADS_PER_PROC, listen_client)
        await raw.load_scripts()
        plane = raw
    else:
        repo = Repository.connect(
            share.url, pool_size=THREADS_PER_PROC // 2, fair_share=settings.fair_share
        )
        ledger = AsyncLedger(
            client, share.namespace, policy, lease_ttl_ms=int(share.cfg.lease_ttl_s * 1000)
        )
        listen_ledger = AsyncLedger(listen_client, share.namespace, policy)
        plane = BackfillPlane(
            repo,
            ledger,
            share.cfg,
            listen_ledger,
            open_limit=THREADS_PER_PROC // 3,
            claim_ledger=Ledger(
                claim_client, share.namespace, policy, int(share.cfg.lease_ttl_s * 1000)
            ),
        )
    rec = Recorder()
    model = h100_node()
    budget = (
        work_budget_policy(settings, share.cfg.max_in_flight)
        if settings.work_budget_enabled
        else None
    )
    nodes = [SimNode(n, plane, model, share.cfg, rec, budget, OUTPUT_TOKENS) for n in share.nodes]
    tasks = [asyncio.create_task(n.run()) for n in nodes]
    await asyncio.sleep(max(0.0, share.measure_from - time.time()))
    rec.measuring = True
    cpu0 = process_cpu_s(os.getpid()) or 0.0
    done0 = sum(n.counters.finished for n in nodes)
    started0 = sum(n.counters.started for n in nodes)
    claims0 = sum(n.counters.claims for n in nodes)
    await asyncio.sleep(max(0.0, share.measure_until - time.time()))
    rec.measuring = False
    cpu1 = process_cpu_s(os.getpid()) or 0.0
    result = {
        "finished": sum(n.counters.finished for n in nodes) - done0,
        "started": sum(n.counters.started for n in nodes) - started0,
        "claims": sum(n.counters.claims for n in nodes) - claims0,
        "in_flight": sum(n.in_flight for n in nodes),
        "cpu_s": cpu1 - cpu0,
        "hist": {k: h.to_json() for k, h in rec.hist.items()},
    }
    deliver(result)
    for n in nodes:
        n.stop(drain=False)
    await cancel_all(tasks)
    if raw is not None:
        raw.close()
    if repo is not None:
        repo.close()
    await client.aclose()
    await listen_client.aclose()
    claim_client.close()
