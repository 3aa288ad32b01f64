"""The fleet benchmark's report over its points: the table, the offered load the nodes' engines
could finish, and the plot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from bench.common import machine, table
from bench.fleet.model import h100_node
from bench.fleet.plane import NodeConfig
from bench.fleet.point import CALLS, GOAL_ITEMS_PER_S, OUTPUT_TOKENS, PROMPT_TOKENS, Point

TIMED_CALLS = ("claim", "start", "reserve", "settle", "heartbeat", "finish", "release")
"""The calls whose latency the report's table shows (all of ``CALLS`` show as rates)."""


def _ms(v: float) -> str:
    return "-" if v != v else f"{v * 1000:.1f}"


def report(points: Sequence[Point]) -> str:
    rows = []
    for p in points:
        rows.append(
            (
                p.nodes,
                p.side,
                round(p.items_per_s),
                p.queued_left,
                *(f"{_ms(p.p(c, 50))}/{_ms(p.p(c, 99))}" for c in TIMED_CALLS),
                f"{p.pg_cpu:.2f}",
                f"{p.redis_cpu:.2f}",
                f"{p.harness_cpu:.2f}",
                f"{p.machine_busy:.2f}",
            )
        )
    head = [
        "nodes",
        "path",
        "items/s",
        "queued left",
        *(f"{c} p50/p99 ms" for c in TIMED_CALLS),
        "pg cpu",
        "redis cpu",
        "harness cpu",
        "machine busy",
    ]
    calls = []
    for p in points:
        calls.append(
            (
                p.nodes,
                p.side,
                *(round(p.rate(c)) for c in CALLS),
                _ms(p.p("tick", 50)) + "/" + _ms(p.p("tick", 99)),
            )
        )
    calls_head = [
        "nodes",
        "path",
        *(f"{_SHORT.get(c, c)}/s" for c in CALLS),
        "tick p50/p99 ms",
    ]
    per_item = []
    for p in points:
        redis_calls = sum(p.rate(c) for c in REDIS_CALLS)
        items = max(p.items_per_s, 1e-9)
        per_item.append(
            (
                p.nodes,
                p.side,
                round(offered_items_per_s(p.nodes)),
                round(p.items_per_s),
                f"{redis_calls / items:.1f}",
                f"{p.redis_cpu / max(redis_calls, 1e-9) * 1e6:.0f}",
                f"{p.pg_cpu / items * 1000:.2f}",
                f"{p.redis_cpu / items * 1000:.2f}",
                f"{p.harness_cpu / items * 1000:.2f}",
            )
        )
    per_item_head = [
        "nodes",
        "path",
        "offered items/s",
        "items/s",
        "redis calls/item",
        "redis cpu us/call",
        "pg cpu ms/item",
        "redis cpu ms/item",
        "harness cpu ms/item",
    ]
    return (
        table(head, rows)
        + "\n\ncalls per second\n"
        + table(calls_head, calls)
        + "\n\ncost per item (CPU of one core)\n"
        + table(per_item_head, per_item)
    )


_SHORT = {"heartbeat": "hb", "heartbeat_pg": "hb_pg", "work_budget": "budget"}
"""Column names of the calls-per-second table (one per ``CALLS`` entry, in its order)."""
REDIS_CALLS = ("reserve", "settle", "heartbeat", "release", "snapshot", "observe")
"""Ledger round trips (the work budget's 4 commands a step come on top)."""


def offered_items_per_s(nodes: int) -> float:
    """What the nodes' engines could finish (the timing model at full batch, prefill aside)."""
    per_node = NodeConfig().max_in_flight / (
        OUTPUT_TOKENS
        * h100_node().decode_step_s(NodeConfig().max_in_flight, PROMPT_TOKENS + OUTPUT_TOKENS // 2)
    )
    return nodes * per_node


def plot(points: Sequence[Point], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - the analysis extra, only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for side, style in (("backfill", "o-"), ("raw", "s--"), ("per-item settle", "^:")):
        ps = [p for p in points if p.side == side]
        if not ps:
            continue
        xs = [p.nodes for p in ps]
        a.plot(xs, [p.items_per_s for p in ps], style, label=side)
        for call, color in (("claim", "C0"), ("reserve", "C1"), ("settle", "C2"), ("finish", "C3")):
            b.plot(
                xs, [p.p(call, 99) * 1000 for p in ps], style, color=color, label=f"{call} ({side})"
            )
    a.axhline(GOAL_ITEMS_PER_S, color="grey", lw=0.8, ls=":", label="goal")
    for ax in (a, b):
        ax.set_xscale("log")
        ax.set_xlabel("simulated H100 nodes")
        ax.legend(fontsize=7)
    a.set_yscale("log")
    a.set_ylabel("items/s sustained")
    b.set_yscale("log")
    b.set_ylabel("p99 latency (ms)")
    a.set_title("Throughput")
    b.set_title("Control-plane call p99")
    fig.suptitle(f"bench.fleet on {machine()} (shared with other work)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
