"""A fleet's control plane on this machine: N simulated GPU nodes on real Postgres and Redis.

Each node (``bench.fleet.node.SimNode``) makes the Repository and ledger calls a
``NodeDispatcher`` makes, in its order, batching and pacing, with the maintenance tick running
as beat runs it; its engine is a timing model of Llama-3.1-8B on one H100 (the simulator's
roofline cost model, ``bench.fleet.model``), so tokens arrive when a real node would make them
and no engine or HTTP work is charged here. Nodes run as asyncio tasks in one or two
processes; their Postgres calls go through one pooled Repository per process (a real fleet of
1,000 workers would need a connection pooler in front of Postgres anyway).

The peer, in the same run: the same fleet and timing model, each call replaced by the bare
SQL statement or Redis command of the same shape (``RawPlane``: claim ``UPDATE ... SKIP
LOCKED``, one-line updates, a two-line Lua reserve/release, HSET/ZADD), no maintenance.

Reported per N: items/s sustained over the measured window, p50/p99 of each call, CPU seconds
per second of Postgres (this database's backends and the server's own processes), Redis and
the harness itself. ``--sweep`` runs N = 10, 100, 300, 1000 and plots ``bench/fleet/fleet.png``.
``--redis-shards 1,3`` also runs Backfill's side with the ledger on a Redis Cluster of that
many masters (no replicas), started here from the installed ``redis-server``
(``devkit.redis_cluster``): the scaling from one shard to several, on the same machine.

This module is the command line; one point runs in :mod:`bench.fleet.run`, each harness
process's nodes in :mod:`bench.fleet.share`, what is measured in :mod:`bench.fleet.point` and
the report in :mod:`bench.fleet.report`.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from bench.common import finish, machine, parser
from bench.fleet.plane import NodeConfig
from bench.fleet.point import CALLS, GOAL_CLAIM_P99_S, GOAL_ITEMS_PER_S, GOAL_RESERVE_P99_S, Point
from bench.fleet.report import plot, report
from bench.fleet.run import run_point
from devkit.redis_cluster import LocalCluster

NAME = "fleet"


SWEEP = (10, 100, 300, 1000)


PLOT = Path(__file__).parent / "fleet.png"


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--sweep", action="store_true", help=f"N = {', '.join(map(str, SWEEP))}")
    p.add_argument("--duration", type=float, default=None, help="measured seconds per point")
    p.add_argument("--warmup", type=float, default=None)
    p.add_argument("--procs", type=int, default=None, help="harness processes (1 or 2)")
    p.add_argument("--no-peer", action="store_true", help="skip the raw floor")
    p.add_argument(
        "--per-item-settle",
        action="store_true",
        help="also run Backfill settling per item per 32 tokens (before settle_many)",
    )
    p.add_argument("--max-items", type=int, default=150_000)
    p.add_argument(
        "--redis-shards",
        default="",
        help="comma-separated master counts: Backfill's side again on a Redis Cluster of each",
    )
    args = p.parse_args()
    shard_counts = [int(x) for x in args.redis_shards.split(",") if x.strip()]
    if any(k < 1 for k in shard_counts):
        p.error("--redis-shards takes counts of at least 1")
    sizes: Sequence[int] = SWEEP if args.sweep else ((10,) if args.quick else (args.nodes,))
    duration = args.duration or (8.0 if args.quick else 30.0)
    warmup = args.warmup or (6.0 if args.quick else 15.0)
    max_items = 20_000 if args.quick else args.max_items
    cfg = NodeConfig()
    print(
        f"bench.fleet: {machine()}; load average {os.getloadavg()[0]:.1f} at start; "
        f"{duration:.0f} s measured after {warmup:.0f} s warm-up per point",
        flush=True,
    )
    points: list[Point] = []
    for n in sizes:
        procs = args.procs or (1 if n <= 100 else 2)
        sides = ["backfill"] + ([] if args.no_peer else ["raw"])
        for side in sides:
            points.append(run_point(n, side, duration, warmup, procs, cfg, max_items))
            print(f"  N={n} {side}: {points[-1].items_per_s:,.0f} items/s", flush=True)
        if args.per_item_settle:
            pt = run_point(
                n,
                "backfill",
                duration,
                warmup,
                procs,
                replace(cfg, settle_batched=False),
                max_items,
            )
            pt.side = "per-item settle"
            points.append(pt)
            print(f"  N={n} per-item settle: {pt.items_per_s:,.0f} items/s", flush=True)
    for k in shard_counts:
        with tempfile.TemporaryDirectory(prefix="bffleet-cluster-") as root:
            cluster = LocalCluster(Path(root), masters=k, replicas=0).start()
            try:
                for n in sizes:
                    procs = args.procs or (1 if n <= 100 else 2)
                    pt = run_point(
                        n, "backfill", duration, warmup, procs, cfg, max_items, cluster.url
                    )
                    pt.side = f"backfill, {k}-shard cluster"
                    points.append(pt)
                    print(f"  N={n} {pt.side}: {pt.items_per_s:,.0f} items/s", flush=True)
            finally:
                cluster.stop()
    print(report(points))
    ratios = {}
    for n in sizes:
        bf = [p for p in points if p.nodes == n and p.side == "backfill"]
        raw = [p for p in points if p.nodes == n and p.side == "raw"]
        if bf and raw and raw[0].items_per_s:
            ratios[n] = bf[0].items_per_s / raw[0].items_per_s
    if ratios:
        print(
            "Backfill / raw floor, items/s: "
            + ", ".join(f"N={n}: {r:.2f}x" for n, r in ratios.items())
        )
    if len(sizes) > 1:
        plot(points, PLOT)
        print(f"plot: {PLOT}")
    top = max((p for p in points if p.side == "backfill"), key=lambda p: p.nodes)
    ok_latency = (
        top.p("claim", 99) <= GOAL_CLAIM_P99_S and top.p("reserve", 99) <= GOAL_RESERVE_P99_S
    )
    details = {
        "points": [
            {
                **{k: v for k, v in p.__dict__.items() if k != "hist"},
                "p50_ms": {c: p.p(c, 50) * 1000 for c in CALLS if c in p.hist},
                "p99_ms": {c: p.p(c, 99) * 1000 for c in CALLS if c in p.hist},
                "calls_per_s": {c: p.rate(c) for c in CALLS if c in p.hist},
            }
            for p in points
        ],
        "ratios_backfill_over_raw": ratios,
        "latency_goals_met_at_top": ok_latency,
    }
    # The goal is at 1,000 nodes with both latency bounds; a smaller run cannot meet it.
    finish(
        NAME,
        "items_per_s",
        top.items_per_s,
        ">=",
        GOAL_ITEMS_PER_S,
        details,
        holds=top.nodes >= 1000 and ok_latency,
    )


if __name__ == "__main__":
    main()
