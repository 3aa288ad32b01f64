"""Sustained churn on the loaded ``items`` table: the worker path against a constant backlog.

``claimers`` processes run what a worker does per batch (``open_claim`` 64 with fair share,
``start_claim``, ``finish`` with a ~200 B result); a feeder queues as many new items as they
finished, so the backlog stays where it began while dead tuples pile up and autovacuum
works. Every ``window_s`` the main process samples ``pg_stat_user_tables`` for items (live
and dead tuples, autovacuum runs), the claim indexes' sizes and any vacuum in progress.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from backfill.models import CLAIMABLE_SQL
from backfill.store import Repository
from bench.pg_scale.load import RESULT, Fleet, feed
from bench.store.claim import run_claim

PER_CLAIM = 64


@dataclass(frozen=True, slots=True)
class Sample:
    at_s: float
    live: int
    dead: int
    vacuums: int
    """Vacuums of items so far (autovacuum's and ``_vacuumer``'s)."""
    heap_bytes: int
    claim_index_bytes: int
    vacuum_phase: str
    backlog: int
    wal_lsn: int
    """The server's WAL position (bytes): all databases' writes, other users' included."""


def _claimer(
    url: str,
    worker: int,
    t0: float,
    stop_at: float,
    done: Any,
    out: mp.Queue,  # type: ignore[type-arg]
) -> None:
    repo = Repository.connect(url, pool_size=1, fair_share=True)
    fence = (worker + 1) << 40
    claims: list[tuple[float, float, int]] = []
    try:
        while time.time() < stop_at:
            began = time.time()
            claim = repo.claims.open_claim(f"churn-{worker}", PER_CLAIM, 60)
            claims.append((began - t0, (time.time() - began) * 1000, len(claim.items)))
            if not claim.items:
                time.sleep(0.02)
                continue
            fence, n = run_claim(
                repo, claim, fence, "c", (320, 60), lambda i: RESULT + str(i) + "}", 50
            )
            with done.get_lock():
                done.value += n
    finally:
        repo.close()
        out.put(claims)


def _feeder(libpq: str, fleet: Fleet, start: int, stop_at: float, done: Any) -> None:
    fed = 0
    with psycopg.connect(libpq, autocommit=True) as conn:
        while time.time() < stop_at:
            want = done.value - fed
            if want > 0:
                feed(conn, fleet, want, start=start + fed)
                fed += want
            time.sleep(0.2)


def _vacuumer(libpq: str, threshold: int, stop_at: float) -> None:
    """What autovacuum would do with ``autovacuum_vacuum_threshold = threshold`` and scale
    factor 0, throttled as autovacuum is by default (cost delay 2 ms, limit 200): for a
    server that runs with autovacuum off, as the development machine's does."""
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute("SET vacuum_cost_delay = '2ms'")
        conn.execute("SET vacuum_cost_limit = 200")
        while time.time() < stop_at:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = 'items'"
            ).fetchone()
            if row is not None and int(row[0]) > threshold:
                conn.execute("VACUUM items")
            time.sleep(1.0)


def _sample(conn: psycopg.Connection[Any], at_s: float, backlog: int) -> Sample:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_live_tup, n_dead_tup, autovacuum_count + vacuum_count, "
        "pg_relation_size('items'), "
        "pg_relation_size('ix_items_claim_edf') + pg_relation_size('ix_items_claim_tenant'), "
        "(SELECT string_agg(phase, ',') FROM pg_stat_progress_vacuum "
        " WHERE relid = 'items'::regclass), pg_current_wal_lsn() - '0/0'::pg_lsn "
        "FROM pg_stat_user_tables WHERE relname = 'items'"
    ).fetchone()
    assert row is not None
    return Sample(
        at_s,
        int(row[0]),
        int(row[1]),
        int(row[2]),
        int(row[3]),
        int(row[4]),
        row[5] or "-",
        backlog,
        int(row[6]),
    )


def churn(
    url: str,
    libpq: str,
    fleet: Fleet,
    *,
    seconds: float,
    claimers: int,
    window_s: float,
    next_custom: int,
    vacuum_threshold: int | None = None,
) -> tuple[list[tuple[float, float, int]], list[Sample], int]:
    """Run the churn; returns every claim ``(began_s, ms, items)``, the samples, items done."""
    ctx = mp.get_context("fork")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    done = ctx.Value("q", 0)
    t0 = time.time() + 1.0
    stop_at = t0 + seconds
    procs = [
        ctx.Process(target=_claimer, args=(url, w, t0, stop_at, done, out)) for w in range(claimers)
    ]
    procs.append(ctx.Process(target=_feeder, args=(libpq, fleet, next_custom, stop_at, done)))
    if vacuum_threshold is not None:
        procs.append(ctx.Process(target=_vacuumer, args=(libpq, vacuum_threshold, stop_at)))
    for p in procs:
        p.start()
    samples = []
    with psycopg.connect(libpq, autocommit=True) as conn:
        backlog0 = _claimable(conn)
        samples.append(_sample(conn, 0.0, backlog0))
        k = 1
        while (due := t0 + k * window_s) <= stop_at + 0.01:
            time.sleep(max(0.0, due - time.time()))
            samples.append(_sample(conn, k * window_s, _claimable(conn)))
            k += 1
    claims: list[tuple[float, float, int]] = []
    for _ in range(claimers):
        claims += out.get()
    for p in procs:
        p.join()
    return claims, samples, int(done.value)


def _claimable(conn: psycopg.Connection[Any]) -> int:
    """Items claimable now (the backlog), by the claim's own partial index."""
    row = conn.execute(f"SELECT count(*) FROM items WHERE state IN ({CLAIMABLE_SQL})").fetchone()
    return int(row[0]) if row else 0
