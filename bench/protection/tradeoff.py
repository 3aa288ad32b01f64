"""The trade-off curve: batch throughput kept against interactive TTFT (p99 and p50, over
interactive alone) for the worker's work budget as its TTFT target moves, and for Backfill's
engine scheduler (``backfill-step``) as its settings move, beside the peers (vLLM's priority
and fcfs scheduling with a fixed batch concurrency, Backfill with KV slack only). Predicted by
the simulator, which runs the worker's own controller (``backfill.work_budget``) and models the
engine scheduler in its step loop; where ``bench/out/protection.json`` holds a sweep of
``python -m bench.protection`` variants, the measured points are drawn beside.

    python -m bench.work_budget_tradeoff [--scenario h100-llama-3.1-8b] [--duration 3600]
                                         [--items 100000] [--quick]

``--quick``: 300 s of the trace and 8,000 batch items (the figures of issue 12's first record).
Writes ``bench/protection/work_budget_tradeoff.png`` and ``bench/out/work_budget_tradeoff.json``
(for another scenario than the default, ``work_budget_tradeoff_<scenario>.png`` and ``.json``;
with ``--quick``, both under ``bench/out/`` with ``_quick`` added, so the committed plots stay
those of the whole trace).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backfill_analysis.simulate import compare
from backfill_analysis.simulate.metrics import PolicyResult
from backfill_analysis.simulate.run import simulate
from backfill_analysis.simulate.scenario import scenario
from backfill_analysis.simulate.trace import AZURE_CODE_TRACE
from bench.common import OUT_DIR
from bench.protection.report import plot_tradeoff

TRACE = str(AZURE_CODE_TRACE)
PLOT = Path(__file__).parent / "work_budget_tradeoff.png"
DEFAULT_SCENARIO = "h100-llama-3.1-8b"
TARGETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0)
CHUNK_TARGETS = (0.005, 0.0075, 0.01, 0.015, 0.02, 0.05, 0.1)
"""backfill-step's batch prefill per step (s), at GPU scale; scaled by the scenario's own
setting over the H100 one (0.01 s) elsewhere."""
RIDE_ALONG = (0.1, 0.25, 0.5, 1.0)
STARVATION_S = (0.1, 0.25, 4.0)
PEERS = ("priority", "fifo", "backfill")


def _point(r: PolicyResult, alone: PolicyResult, flat: PolicyResult) -> dict[str, Any]:
    return {
        "ttft_p50_ratio": r.ttft_p50_s / alone.ttft_p50_s,
        "ttft_p99_ratio": r.ttft_p99_s / alone.ttft_p99_s,
        "batch_kept": r.batch_tokens_per_s / flat.batch_tokens_per_s,
        "preemptions": r.preemptions,
        "recomputed_tokens": r.recomputed_tokens,
    }


def step_settings(base_chunk_s: float) -> list[tuple[str, str, float]]:
    """backfill-step's sweep: (series, knob, value). The chunk target swept with nothing
    riding along; then, at the scenario's chunk target, the ride-along share and the
    starvation bound."""
    scale = base_chunk_s / 0.01
    out = [("chunk target", "chunk_target_s", c * scale) for c in CHUNK_TARGETS]
    out += [("ride-along share", "ride_along_share", r) for r in RIDE_ALONG]
    out += [("starvation bound", "starvation_s", t) for t in STARVATION_S]
    return out


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
        points.append({"ttft_target_s": target, **_point(r, alone, flat)})
    step = []
    for series, knob, value in step_settings(sc.knobs.step_schedule.chunk_target_s):
        knobs = compare._with_knob(sc.knobs, knob, value)
        r = simulate(compare._spec(sc, trace, batch, knobs), "backfill-step")
        step.append(
            {
                "series": series,
                "settings": dataclasses.asdict(knobs.step_schedule),
                "knob": knob,
                "value": value,
                **_point(r, alone, flat),
            }
        )
    others = {}
    for policy in PEERS:
        r = simulate(compare._spec(sc, trace, batch), policy)
        others[policy] = _point(r, alone, flat)
    return {
        "scenario": name,
        "duration_s": duration_s,
        "interactive_requests": len(trace),
        "batch_items": len(batch),
        "alone_ttft_p50_s": alone.ttft_p50_s,
        "alone_ttft_p99_s": alone.ttft_p99_s,
        "batch_alone_tokens_per_s": flat.batch_tokens_per_s,
        "budget": points,
        "step": step,
        "step_default": dataclasses.asdict(sc.knobs.step_schedule),
        "batch_concurrency": sc.knobs.batch_concurrency,
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


_PEER_LABELS = {
    "priority": "vLLM priority (batch concurrency {c})",
    "fifo": "vLLM fcfs (batch concurrency {c})",
    "backfill": "Backfill, KV slack only",
}
_STEP_STYLE = {
    "chunk target": ("D-", "#c05621", (4, -9)),
    "ride-along share": ("v--", "#805ad5", (-20, -3)),
    "starvation bound": ("^:", "#2f855a", (5, -3)),
}


def _panel(ax: Any, sim: dict[str, Any], metric: str) -> None:
    pts = sim["budget"]
    ax.plot(
        [p["batch_kept"] for p in pts],
        [p[metric] for p in pts],
        "o-",
        color="#2b6cb0",
        label="work budget (TTFT target swept)",
    )
    for p in pts:
        ax.annotate(
            f"{p['ttft_target_s']:g}s",
            (p["batch_kept"], p[metric]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=7,
            color="#2b6cb0",
        )
    for series, (style, color, offset) in _STEP_STYLE.items():
        line = [p for p in sim["step"] if p["series"] == series]
        if not line:
            continue
        ax.plot(
            [p["batch_kept"] for p in line],
            [p[metric] for p in line],
            style,
            color=color,
            label=f"backfill-step ({series} swept)",
            ms=4,
        )
        for p in line:
            text = (
                f"{p['value'] * 1000:g}ms"
                if p["knob"] == "chunk_target_s"
                else (f"{p['value']:g}" + ("s" if p["knob"] == "starvation_s" else ""))
            )
            ax.annotate(
                text,
                (p["batch_kept"], p[metric]),
                textcoords="offset points",
                xytext=offset,
                fontsize=7,
                color=color,
            )
    # The axis spans the swept curves; a peer beyond it sits on the top edge, its value said.
    ours = [p[metric] for p in (*pts, *sim["step"])]
    top = max(ours) + 0.2
    ax.set_ylim(min(0.95, *ours), top)
    markers = itertools.cycle(("s", "P", "X"))
    for name, o in sim["others"].items():
        y = min(o[metric], top - 0.04)
        ax.plot(
            [o["batch_kept"]],
            [y],
            next(markers),
            color="#4a5568",
            ms=7,
            label=_PEER_LABELS.get(name, name).format(c=sim["batch_concurrency"]),
        )
        if o[metric] > y:
            ax.annotate(
                f"x{o[metric]:.2f} (off scale)",
                (o["batch_kept"], y),
                textcoords="offset points",
                xytext=(-30, -14),
                fontsize=7,
            )
    ax.axhline(1.0, color="black", lw=0.6)
    ax.axhline(1.1, color="grey", ls="--", lw=0.8, label="1.1x (issue 12)")
    ax.axvline(0.6, color="grey", ls="-.", lw=0.8, label="60% kept")
    ax.set_xlabel("batch throughput kept (share of batch alone)")
    which = "p99" if metric == "ttft_p99_ratio" else "p50"
    ax.set_ylabel(f"interactive TTFT {which} / interactive alone")
    ax.grid(alpha=0.3)


def plot(sim: dict[str, Any], real: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - plotting loads only when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    panels = 3 if real else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5.8), squeeze=False)
    where = (
        f"Simulated: {sim['scenario']}, {sim['duration_s']:g} s of trace "
        f"({sim['interactive_requests']} interactive)"
    )
    for ax, metric in zip(axes[0], ("ttft_p99_ratio", "ttft_p50_ratio"), strict=False):
        _panel(ax, sim, metric)
        ax.set_title(f"{where}: TTFT {'p99' if metric == 'ttft_p99_ratio' else 'p50'}", fontsize=9)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8)
    if real:
        # The same panel bench.protection draws, from its recorded points.
        plot_tradeoff(axes[0][2], real)
        axes[0][2].set_title("Measured: bench.protection, vLLM CPU (grey: vLLM alone)", fontsize=9)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _line(label: str, p: dict[str, Any]) -> str:
    return (
        f"{label}: TTFT p50 x{p['ttft_p50_ratio']:.2f} p99 x{p['ttft_p99_ratio']:.2f}, "
        f"batch kept {p['batch_kept']:.0%}, {p['preemptions']} preemptions, "
        f"{p['recomputed_tokens']:,} tokens recomputed"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--scenario", default=DEFAULT_SCENARIO)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of trace (default: the scenario's, 300 with --quick)",
    )
    p.add_argument(
        "--items",
        type=int,
        default=None,
        help="batch items (default: the scenario's, 8,000 with --quick)",
    )
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    sc = scenario(args.scenario)
    duration = args.duration or (300.0 if args.quick else sc.duration_s)
    items = args.items or (8000 if args.quick else sc.batch.items)
    sim = simulated(args.scenario, duration, items)
    real = measured()
    print(
        f"{sim['scenario']}: {duration:g} s, {sim['interactive_requests']} interactive "
        f"requests, {sim['batch_items']:,} batch items; interactive alone TTFT p50 "
        f"{sim['alone_ttft_p50_s']:.3f} s p99 {sim['alone_ttft_p99_s']:.3f} s, batch alone "
        f"{sim['batch_alone_tokens_per_s']:,.0f} tok/s"
    )
    for pt in sim["budget"]:
        print(_line(f"work budget, target {pt['ttft_target_s']:g} s", pt))
    for pt in sim["step"]:
        print(_line(f"backfill-step, {pt['knob']} {pt['value']:g}", pt))
    for name, o in sim["others"].items():
        print(_line(name, o))
    stem = PLOT.stem if args.scenario == DEFAULT_SCENARIO else f"{PLOT.stem}_{args.scenario}"
    if args.quick:
        stem += "_quick"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"{stem}.json").write_text(
        json.dumps({"simulated": sim, "measured": real}, indent=2)
    )
    path = (OUT_DIR if args.quick else PLOT.parent) / f"{stem}.png"
    plot(sim, real, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
