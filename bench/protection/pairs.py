"""Where scenario ``a``'s extra TTFT goes: its interactive requests paired one by one with the
same requests (same trace index, same arrival) in a baseline scenario of the same run, grouped
by how long the engine had been without a new interactive request when each arrived.

A p50 or p99 ratio says how much worse; the pairs say for which requests. Burst arrivals wait
behind the requests before them in both scenarios; a request after a quiet spell meets a batch
step in flight (and, after ``lift_cap_after_s`` of quiet, an uncapped one).

``python -m bench.protection.pairs [RECORD]`` reads a ``bench.protection`` record (default
``bench/out/protection.json``); ``bench.protection`` prints the same table after its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, table

# Seconds since the previous interactive arrival: a burst, a short gap, a gap long enough for
# the scheduler to lift its chunk cap (BACKFILL_SCHED_LIFT_CAP_AFTER_S, 10 s by default).
GAP_EDGES = (1.0, 10.0)


@dataclass(frozen=True, slots=True)
class Pair:
    index: int
    arrival_s: float
    gap_s: float
    """Seconds since the previous interactive request arrived (inf for the first)."""
    prompt_tokens: int
    base_ttft_s: float
    ttft_s: float

    @property
    def extra_s(self) -> float:
        return self.ttft_s - self.base_ttft_s


def pairs(base: Mapping[str, Any], other: Mapping[str, Any]) -> list[Pair]:
    """The requests answered in both scenarios, by trace index, in arrival order."""
    answered = {r["index"]: r for r in base.get("requests", ()) if r.get("ttft_s") is not None}
    ordered = sorted(other.get("requests", ()), key=lambda r: r["arrival_s"])
    out: list[Pair] = []
    previous: float | None = None
    for r in ordered:
        gap = float("inf") if previous is None else r["arrival_s"] - previous
        previous = r["arrival_s"]
        b = answered.get(r["index"])
        if b is None or r.get("ttft_s") is None:
            continue
        out.append(
            Pair(r["index"], r["arrival_s"], gap, r["prompt_tokens"], b["ttft_s"], r["ttft_s"])
        )
    return out


def bucket(gap_s: float) -> str:
    low = 0.0
    for edge in GAP_EDGES:
        if gap_s < edge:
            return f"{low:g}-{edge:g} s"
        low = edge
    return f">= {low:g} s"


def buckets(found: Sequence[Pair]) -> list[tuple[Any, ...]]:
    """One row per gap bucket: requests, median base and other TTFT, median extra, its share
    of the whole extra."""
    total = sum(p.extra_s for p in found) or 1.0
    names = [bucket(0.0)] + [bucket(e) for e in GAP_EDGES]
    rows: list[tuple[Any, ...]] = []
    for name in [*names, "all"]:
        group = [p for p in found if name == "all" or bucket(p.gap_s) == name]
        if not group:
            continue
        rows.append(
            (
                name,
                len(group),
                f"{statistics.median(p.base_ttft_s for p in group):.3f}",
                f"{statistics.median(p.ttft_s for p in group):.3f}",
                f"{statistics.median(p.extra_s for p in group):+.3f}",
                f"{sum(p.extra_s for p in group) / total:.0%}",
            )
        )
    return rows


HEADERS = ["gap before arrival", "n", "base TTFT p50", "TTFT p50", "extra p50", "share of extra"]


def report(summaries: Sequence[Mapping[str, Any]], other: str = "a") -> str | None:
    """The pairs table of ``other`` against the run's best baseline (``alone-sched`` when the
    run has it, else ``alone``), or None when either is missing."""
    named = {s["scenario"]: s for s in summaries}
    base_name = next((n for n in ("alone-sched", "alone") if n in named), None)
    if base_name is None or other not in named:
        return None
    found = pairs(named[base_name], named[other])
    if not found:
        return None
    worst = sorted(found, key=lambda p: p.extra_s, reverse=True)[:5]
    lines = [
        f"{other} against {base_name}, request by request ({len(found)} pairs):",
        table(HEADERS, buckets(found)),
        "most delayed: "
        + "; ".join(
            f"#{p.index} at {p.arrival_s:.1f} s (gap {p.gap_s:.1f} s, {p.prompt_tokens} tok) "
            f"{p.base_ttft_s:.2f} -> {p.ttft_s:.2f} s"
            for p in worst
        ),
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.protection.pairs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("record", nargs="?", type=Path, default=OUT_DIR / "protection.json")
    p.add_argument("--scenario", default="a", help="the scenario to pair (default a)")
    args = p.parse_args(argv)
    record = json.loads(args.record.read_text())
    summaries = record.get("details", record).get("scenarios", [])
    text = report(summaries, args.scenario)
    if text is None:
        raise SystemExit(f"{args.record}: no {args.scenario} and alone/alone-sched to pair")
    print(text)


if __name__ == "__main__":
    main()
