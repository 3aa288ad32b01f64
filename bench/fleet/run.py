"""One point of ``bench.fleet``: a scratch database loaded with items, the nodes registered,
the maintenance tick run as beat runs it, the harness processes started, and the window's
items, latencies and CPU gathered into a :class:`bench.fleet.point.Point`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import secrets
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import psycopg
import redis
import redis.asyncio

from backfill.config import get_settings, libpq_url
from backfill.ledger import Ledger
from backfill.maintenance import ensure_ledger, pool_policy, tick
from backfill.redis_client import is_cluster_url
from backfill.states import JobState
from backfill.store import NewItem, Repository
from backfill_analysis.simulate.scenario import h100_llama8b
from bench.common import scratch_database
from bench.fleet.model import h100_node
from bench.fleet.plane import NodeConfig
from bench.fleet.point import BODY, OUTPUT_TOKENS, PROMPT_TOKENS, Point
from bench.fleet.share import Share, child
from bench.fleet.stats import (
    Histogram,
    cpu_delta,
    cpu_of,
    machine_busy_s,
    merged,
    pids_named,
)


def _load_items(url: str, count: int) -> None:
    repo = Repository.connect(url)
    try:
        tenant = repo.tenants.create_tenant("fleet")
        f = repo.files.create_file(tenant.id, "batch", "in.jsonl", None, size_bytes=0)
        per_job = 50_000
        for j in range(0, count, per_job):
            job = repo.jobs.create_job(
                tenant.id,
                f.id,
                "/v1/chat/completions",
                "24h",
                datetime.now(UTC) + timedelta(days=1, seconds=j),
            )
            n = min(per_job, count - j)
            repo.ingest.insert_items(
                job.id,
                (NewItem(i, f"r{i}", BODY, OUTPUT_TOKENS, PROMPT_TOKENS, None) for i in range(n)),
            )
            repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    finally:
        repo.close()


def _node_names(n: int) -> list[str]:
    return [f"sim-{i:04d}" for i in range(n)]


def _register(url: str, redis_url: str, namespace: str, nodes: Sequence[str]) -> None:
    settings = get_settings()
    engine = h100_llama8b().engine
    policy = pool_policy(settings)
    capacity = engine.num_blocks * engine.block_size
    repo = Repository.connect(url, pool_size=2)
    ledger = Ledger.from_url(redis_url, namespace, policy)
    try:
        for node in nodes:
            repo.nodes.upsert_node(
                node,
                "http://sim",
                "m",
                engine.num_blocks,
                engine.block_size,
                policy.reserve_tokens(capacity),
            )
        ensure_ledger(repo, ledger, max_preemptions=settings.max_preemptions_per_item)
    finally:
        repo.close()


def _drop_namespace(redis_url: str, namespace: str) -> None:
    if is_cluster_url(redis_url):
        return  # the benchmark's own cluster, stopped after the run
    client = redis.Redis.from_url(redis_url)
    try:
        batch = []
        for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                client.delete(*batch)
                batch.clear()
        if batch:
            client.delete(*batch)
    finally:
        client.close()


class Maintenance(threading.Thread):
    def __init__(self, url: str, redis_url: str, namespace: str, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.url, self.redis_url, self.namespace, self.interval_s = (
            url,
            redis_url,
            namespace,
            interval_s,
        )
        self.stop = threading.Event()
        self.hist = Histogram()
        self.measuring = False

    def run(self) -> None:
        settings = get_settings()
        repo = Repository.connect(self.url, pool_size=2)
        ledger = Ledger.from_url(self.redis_url, self.namespace, pool_policy(settings))
        try:
            while not self.stop.wait(self.interval_s):
                t0 = time.perf_counter()
                try:
                    tick(repo, ledger, settings)
                except Exception as exc:  # a failed tick is retried by the next, as in beat
                    print(f"maintenance tick failed: {exc!r}")
                if self.measuring:
                    self.hist.add(time.perf_counter() - t0)
        finally:
            repo.close()


def _our_postgres_pids(url: str) -> list[int]:
    """This database's backends and the server's own processes (checkpointer, WAL writer,
    autovacuum), not other databases' backends (other helpers' tests share the server)."""
    dbname = url.rpartition("/")[2]
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s OR backend_type <> "
            "'client backend'",
            (dbname,),
        ).fetchall()
    mine = os.getpid()
    return [r[0] for r in rows if r[0] != mine]


def run_point(
    nodes: int,
    side: str,
    duration_s: float,
    warmup_s: float,
    procs: int,
    cfg: NodeConfig,
    max_items: int,
    redis_url: str | None = None,
) -> Point:
    """One side's run at ``nodes`` nodes; the ledger on ``redis_url`` (the configured Redis
    when None; a ``redis+cluster://`` URL puts it on a Redis Cluster)."""
    settings = get_settings()
    redis_url = redis_url or settings.redis_url
    namespace = f"bffleet-{secrets.token_hex(4)}"
    names = _node_names(nodes)
    per_node_rate = 128 / (OUTPUT_TOKENS * h100_node().decode_step_s(128, PROMPT_TOKENS + 150))
    want_items = int(nodes * per_node_rate * (warmup_s + duration_s) * 1.3) + nodes * 128
    count = max(2_000, min(max_items, want_items))
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(_drop_namespace, redis_url, namespace)
        url = cleanup.enter_context(scratch_database("bffleet"))
        _load_items(url, count)
        _register(url, redis_url, namespace, names)
        maint = (
            Maintenance(url, redis_url, namespace, settings.reaper_interval_s)
            if side == "backfill"
            else None
        )
        try:
            t_start = time.time() + 2.0  # the children's start-up
            share_of = [tuple(names[i::procs]) for i in range(procs)]
            ctx = mp.get_context("fork")
            out = ctx.Queue()
            children = [
                ctx.Process(
                    target=child,
                    args=(
                        Share(
                            side,
                            url,
                            redis_url,
                            namespace,
                            s,
                            cfg,
                            t_start + warmup_s,
                            t_start + warmup_s + duration_s,
                        ),
                        out,
                    ),
                )
                for s in share_of
                if s
            ]
            for c in children:
                c.start()
            if maint is not None:  # after the fork: a forked thread's locks would be copied
                maint.start()
            time.sleep(max(0.0, t_start + warmup_s - time.time()))
            if maint is not None:
                maint.measuring = True
            pg_pids = _our_postgres_pids(url)
            redis_pids = pids_named("redis-server")
            pg0, rd0, busy0 = cpu_of(pg_pids), cpu_of(redis_pids), machine_busy_s()
            time.sleep(max(0.0, t_start + warmup_s + duration_s - time.time()))
            pg_pids = sorted(set(pg_pids) | set(_our_postgres_pids(url)))
            pg1, rd1, busy1 = cpu_of(pg_pids), cpu_of(redis_pids), machine_busy_s()
            if maint is not None:
                maint.measuring = False
            results = [out.get(timeout=120) for _ in children]
            for c in children:
                c.join(timeout=60)
                if c.is_alive():
                    # Its figures are in; a teardown held up (once in ~10 runs at 1,000 nodes,
                    # 2026-12-04, cause not found) must not hold the benchmark up.
                    print(f"a harness process ({c.pid}) had not exited 60 s after its figures")
                    c.kill()
                    c.join(timeout=10)
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                raise RuntimeError(f"a fleet process failed: {errors}")
        finally:
            if maint is not None and maint.is_alive():
                maint.stop.set()
                maint.join(timeout=60)
        with psycopg.connect(libpq_url(url), autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM items WHERE state = 'queued'").fetchone()
            queued_left = int(row[0]) if row else 0
    hist = merged({k: Histogram.from_json(v) for k, v in r["hist"].items()} for r in results)
    if maint is not None and maint.hist.total:
        hist["tick"] = maint.hist
    return Point(
        nodes=nodes,
        side=side,
        duration_s=duration_s,
        items_per_s=sum(r["finished"] for r in results) / duration_s,
        started=sum(r["started"] for r in results),
        claims=sum(r["claims"] for r in results),
        queued_left=queued_left,
        hist=hist,
        pg_cpu=cpu_delta(pg0, pg1) / duration_s,
        redis_cpu=cpu_delta(rd0, rd1) / duration_s,
        harness_cpu=sum(r["cpu_s"] for r in results) / duration_s,
        machine_busy=(busy1[0] - busy0[0]) / max(busy1[1] - busy0[1], 1e-9) * (os.cpu_count() or 1),
        extra={
            "items_loaded": count,
            "in_flight_at_end": sum(r["in_flight"] for r in results),
            "procs": len(children),
        },
    )
