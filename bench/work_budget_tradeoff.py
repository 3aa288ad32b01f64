"""The work budget's trade-off curve: batch throughput against interactive TTFT p99 as its
TTFT target moves, predicted by the simulator (which runs the worker's own controller,
``backfill.work_budget``) and, where ``bench/out/protection.json`` holds a sweep of
``python -m bench.protection`` variants, measured on the real engine.

    python -m bench.work_budget_tradeoff [--scenario h100-llama-3.1-8b] [--duration 300]

Writes ``bench/work_budget_tradeoff.png`` and ``bench/out/work_budget_tradeoff.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from backfill.simulate import compare
from backfill.simulate.run import simulate
from backfill.simulate.scenario import scenario
from bench.common import OUT_DIR
from bench.protection import plot_tradeoff

TRACE = "/work/shared/traces/azure_llm_2023_code.csv"
PLOT = Path(__file__).parent / "work_budget_tradeoff.png"
TARGETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)


def simulated(name: str, duration_s: float, items: int) -> dict[str, Any]:
    sc = scenario(name)
    sc = dataclasses.replace(
        sc, duration_s=duration_s, batch=dataclasses.replace(sc.batch, items=items)
    )
    trace, batch = compare.workload(sc, TRACE, 0)
    base = compare.baselines(sc, trace, batch)
    alone, flat = base.interactive_alone, base.batch_alone
    points = []
    for target in TARGETS:
        knobs = compare._with_knob(sc.knobs, "budget_ttft_target_s", target)
        r = simulate(compare._spec(sc, trace, batch, knobs), "backfill-budget")
        points.append(
            {
                "ttft_target_s": target,
                "ttft_p50_ratio": r.ttft_p50_s / alone.ttft_p50_s,
                "ttft_p99_ratio": r.ttft_p99_s / alone.ttft_p99_s,
                "batch_kept": r.batch_tokens_per_s / flat.batch_tokens_per_s,
                "preemptions": r.preemptions,
            }
        )
    others = {}
    for policy in ("priority", "backfill"):
        r = simulate(compare._spec(sc, trace, batch), policy)
        others[policy] = {
            "ttft_p50_ratio": r.ttft_p50_s / alone.ttft_p50_s,
            "ttft_p99_ratio": r.ttft_p99_s / alone.ttft_p99_s,
            "batch_kept": r.batch_tokens_per_s / flat.batch_tokens_per_s,
        }
    return {
        "scenario": name,
        "duration_s": duration_s,
        "interactive_requests": len(trace),
        "alone_ttft_p50_s": alone.ttft_p50_s,
        "alone_ttft_p99_s": alone.ttft_p99_s,
        "batch_alone_tokens_per_s": flat.batch_tokens_per_s,
        "budget": points,
        "others": others,
    }


def measured() -> list[dict[str, Any]]:
    """The trade-off points of the last ``bench.protection`` record (Backfill's variants and
    the peers, each against its own path's batch alone), if any."""
    path = OUT_DIR / "protection.json"
    if not path.is_file():
        return []
    record = json.loads(path.read_text())
    points: list[dict[str, Any]] = record.get("details", record).get("tradeoff", [])
    return points


def plot(sim: dict[str, Any], real: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - plotting loads only when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, 2 if real else 1, figsize=(13 if real else 7, 4.8), squeeze=False)
    ax = axes[0][0]
    pts = sim["budget"]
    ax.plot([p["batch_kept"] for p in pts], [p["ttft_p99_ratio"] for p in pts], "o-",
            label="Backfill + work budget (TTFT target swept)")
    for p in pts:
        ax.annotate(f"{p['ttft_target_s']:g}s", (p["batch_kept"], p["ttft_p99_ratio"]),
                    textcoords="offset points", xytext=(4, 4), fontsize=8)
    for name, o in sim["others"].items():
        ax.plot([o["batch_kept"]], [o["ttft_p99_ratio"]], "s", label=name)
    ax.set_title(f"Simulated: {sim['scenario']}, {sim['duration_s']:g} s of trace", fontsize=10)
    if real:
        # The same panel bench.protection draws, from its recorded points.
        plot_tradeoff(axes[0][1], real)
        axes[0][1].set_title("Measured: bench.protection, vLLM CPU (grey: vLLM alone)",
                             fontsize=10)
    ax.axhline(1.1, color="grey", ls="--", lw=0.8)
    ax.axvline(0.6, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("batch throughput kept (share of batch alone)")
    ax.set_ylabel("interactive TTFT p99 / interactive alone")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--scenario", default="h100-llama-3.1-8b")
    p.add_argument("--duration", type=float, default=300.0)
    p.add_argument("--items", type=int, default=8000)
    args = p.parse_args(argv)
    sim = simulated(args.scenario, args.duration, args.items)
    real = measured()
    for pt in sim["budget"]:
        print(f"target {pt['ttft_target_s']:>5g} s: TTFT p50 x{pt['ttft_p50_ratio']:.2f} "
              f"p99 x{pt['ttft_p99_ratio']:.2f}, batch kept {pt['batch_kept']:.0%}, "
              f"{pt['preemptions']} preemptions")
    for name, o in sim["others"].items():
        print(f"{name}: TTFT p50 x{o['ttft_p50_ratio']:.2f} p99 x{o['ttft_p99_ratio']:.2f}, "
              f"batch kept {o['batch_kept']:.0%}")
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / "work_budget_tradeoff.json").write_text(
        json.dumps({"simulated": sim, "measured": real}, indent=2)
    )
    plot(sim, real, PLOT)
    print(f"wrote {PLOT}")


if __name__ == "__main__":
    main()
