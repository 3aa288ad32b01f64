"""The protection run's report, pure over the scenarios' summaries: the table rows, the plot,
the trade-off points (batch kept against interactive TTFT) and the goals and closing verdict.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.protection import plan

GOAL_TTFT_RATIO = plan.GOAL_TTFT_RATIO
GOAL_BATCH_KEPT = plan.GOAL_BATCH_KEPT


def fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    out = []
    for s in summaries:
        bf = s["backfill"]
        out.append(
            (
                s["scenario"],
                s["policy"],
                s["batch"] or "—",
                f"{s['interactive_ok']}/{s['interactive_requests']}"
                if s["interactive_requests"]
                else "—",
                f"{fmt(s['ttft_p50_s'])} / {fmt(s['ttft_p99_s'])}",
                fmt(s["itl_p99_s"], 3),
                f"{s['interactive_busy']:.0%}" if s.get("interactive_busy") is not None else "—",
                f"{s['interactive_rejected']} / {s['interactive_failed']}"
                if s["interactive_requests"]
                else "—",
                fmt(s["batch_output_tokens_per_s"], 1),
                fmt(s.get("batch_tokens_processed_per_s"), 0),
                f"{s['engine_load']['running_mean']:.0f}"
                if "running_mean" in s["engine_load"]
                else "—",
                int(s["engine_preemptions"]),
                int(bf["backfill_gateway_batch_preemptions_total"]) if bf else "—",
                int(bf["recomputed_tokens_on_resume"]) if bf else "—",
                f"{s['loadavg_1m_5m_15m'][0]:.1f}",
                _cores(s.get("cpu_cores") or {}),
            )
        )
    return out


def _cores(cpu: dict[str, float]) -> str:
    """Cores the engine core and the engine's API process used / cores all else used."""
    if not cpu:
        return "—"
    beside = sum(v for k, v in cpu.items() if not k.startswith("engine"))
    return f"{cpu.get('engine_core', 0.0):.2f}+{cpu.get('engine_api', 0.0):.2f} / {beside:.2f}"


HEADERS = [
    "scenario", "engine", "batch", "int ok", "TTFT p50 / p99 s", "ITL p99 s", "int busy",
    "rejected / failed", "batch out tok/s", "batch all tok/s", "running", "engine preempt",
    "Backfill preempt", "recomputed tok", "load 1m", "cores core+api / beside",
]  # fmt: skip


def plot(summaries: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - plotting loads only when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    points = tradeoff_points(summaries)
    fig, axes = plt.subplots(1, 3 if points else 2, figsize=(16.5 if points else 11, 4.6))
    cdf, bars = axes[0], axes[1]
    for s in summaries:
        ttfts = sorted(r["ttft_s"] for r in s["requests"] if r["ttft_s"] is not None)
        if not ttfts:
            continue
        ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        cdf.step(ttfts, ys, where="post", label=f"{s['scenario']} (p99 {s['ttft_p99_s']:.2f} s)")
    cdf.set_xlabel("interactive time to first token (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("Interactive TTFT, CDF per scenario", fontsize=10)
    cdf.grid(alpha=0.3)
    if cdf.get_legend_handles_labels()[0]:
        cdf.legend(fontsize=8, loc="lower right")
    batch = [s for s in summaries if s["batch_output_tokens_per_s"] is not None]
    names = [s["scenario"] for s in batch]
    values = [s["batch_output_tokens_per_s"] for s in batch]
    colours = ["#2b6cb0" if s["batch"] == "backfill" else "#a0aec0" for s in batch]
    bars.bar(names, values, color=colours)
    for x, v in enumerate(values):
        bars.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
    bars.set_ylabel("batch output tokens/s (engine count)")
    bars.set_title("Batch throughput per scenario (blue: through Backfill)", fontsize=10)
    bars.tick_params(axis="x", labelsize=8, rotation=20)
    if points:
        plot_tradeoff(axes[2], points)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(ax: Any, points: Sequence[dict[str, Any]]) -> None:
    """Batch kept against interactive TTFT p99, one point per scenario that ran both: the
    Backfill variants joined in order of the batch they kept, the peers apart."""
    ours = sorted((p for p in points if p["batch"] == "backfill"), key=lambda p: p["batch_kept"])
    peers = [p for p in points if p["batch"] != "backfill"]
    if ours:
        ax.plot(
            [p["batch_kept"] for p in ours],
            [p["ttft_p99_ratio"] for p in ours],
            "o-",
            color="#2b6cb0",
            label="Backfill (settings swept)",
        )
    for p in peers:
        ax.plot([p["batch_kept"]], [p["ttft_p99_ratio"]], "s", color="#a0aec0")
    for p in points:
        ax.annotate(
            p["label"],
            (p["batch_kept"], p["ttft_p99_ratio"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.axhline(1.0, color="black", lw=0.6)
    ax.axhline(GOAL_TTFT_RATIO, color="grey", ls="--", lw=0.8, label="TTFT goal (issue 7)")
    ax.axhline(1.1, color="grey", ls=":", lw=0.8, label="TTFT goal (issue 12)")
    ax.axvline(GOAL_BATCH_KEPT, color="grey", ls="-.", lw=0.8, label="batch kept goal")
    ax.set_xlabel("batch throughput kept (share of the same path's batch alone)")
    ax.set_ylabel("interactive TTFT p99 / interactive alone")
    ax.set_title("Trade-off: batch kept vs interactive TTFT p99 (grey: vLLM alone)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def tradeoff_points(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mixed scenario (``a``, its variants, ``b``, ``c``) as a point of the trade-off:
    interactive TTFT p50/p99 over interactive alone's, and batch throughput over the same
    path's batch alone (Backfill's over ``batch-backfill``, the peers' over
    ``batch-straight``). Scenarios without the figures they need are left out."""
    by = by_name(summaries)
    alone = by.get("alone", {})
    a50, a99 = alone.get("ttft_p50_s"), alone.get("ttft_p99_s")
    flat = {
        "backfill": by.get("batch-backfill", {}).get("batch_output_tokens_per_s"),
        "straight": by.get("batch-straight", {}).get("batch_output_tokens_per_s"),
    }
    out = []
    for s in summaries:
        name = s["scenario"]
        if not (name in ("a", "b", "c") or name.startswith("a:")):
            continue
        base = flat.get(s["batch"] or "")
        p50, p99, tps = s["ttft_p50_s"], s["ttft_p99_s"], s["batch_output_tokens_per_s"]
        if not (a50 and a99 and base and p50 is not None and p99 is not None and tps is not None):
            continue
        label = name
        if name == "a":
            label = "a (" + (",".join(f"{k}={v}" for k, v in s["overrides"].items()) or "defaults")
            label += ")"
        out.append(
            {
                "scenario": name,
                "label": label,
                "batch": s["batch"],
                "overrides": s["overrides"],
                "ttft_p50_ratio": p50 / a50,
                "ttft_p99_ratio": p99 / a99,
                "batch_kept": tps / base,
            }
        )
    return out


def by_name(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["scenario"]: s for s in summaries}


def verdicts(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, each None when a scenario it needs was not run."""
    by = by_name(summaries)

    def get(name: str, key: str) -> float | None:
        v = by.get(name, {}).get(key)
        return float(v) if v is not None else None

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num is not None and den else None

    alone, a = get("alone", "ttft_p99_s"), get("a", "ttft_p99_s")
    out: dict[str, Any] = {
        "ttft_p50_ratio": ratio(get("a", "ttft_p50_s"), get("alone", "ttft_p50_s")),
        "ttft_p99_ratio": ratio(a, alone),
        "itl_p99_ratio": ratio(get("a", "itl_p99_s"), get("alone", "itl_p99_s")),
    }
    for peer in ("b", "c"):
        theirs = get(peer, "ttft_p99_s")
        out[f"a_ttft_p99_below_{peer}"] = a < theirs if a is not None and theirs else None
    bf_alone, bf_a = (
        get("batch-backfill", "batch_output_tokens_per_s"),
        get("a", "batch_output_tokens_per_s"),
    )
    out["batch_kept_a"] = ratio(bf_a, bf_alone)
    a_row = by.get("a", {})
    recomputed = (a_row.get("backfill") or {}).get("recomputed_tokens_on_resume")
    out["recomputed_share_a"] = ratio(
        float(recomputed) if recomputed is not None else None, get("a", "batch_tokens_processed")
    )
    straight = get("batch-straight", "batch_output_tokens_per_s")
    out["batch_backfill_vs_straight"] = ratio(bf_alone, straight)
    # Prompt and output tokens together: a window shorter than a few of straight's waves
    # (all prefill, then all decode) catches one phase, and output tokens alone then judge
    # the phase rather than the work done.
    out["batch_backfill_vs_straight_all_tokens"] = ratio(
        get("batch-backfill", "batch_tokens_processed_per_s"),
        get("batch-straight", "batch_tokens_processed_per_s"),
    )
    for name in ("b", "c"):
        out[f"batch_kept_{name}"] = ratio(get(name, "batch_output_tokens_per_s"), straight)
    out["alone_sched_ttft_p50_ratio"] = ratio(
        get("alone-sched", "ttft_p50_s"), get("alone", "ttft_p50_s")
    )
    out["alone_sched_ttft_p99_ratio"] = ratio(get("alone-sched", "ttft_p99_s"), alone)
    for s in summaries:
        if s["scenario"].startswith("a:") and alone:
            p99 = s["ttft_p99_s"]
            tps = s["batch_output_tokens_per_s"]
            out[f"{s['scenario']}_ttft_p99_ratio"] = p99 / alone if p99 is not None else None
            out[f"{s['scenario']}_batch_kept"] = tps / bf_alone if tps and bf_alone else None
    return out


def closing_verdict(
    summaries: Sequence[dict[str, Any]], goals: dict[str, Any], median_prefill_s: float
) -> plan.Verdict:
    """The headline ``a`` judged on TTFT p50, p99 and batch kept together, or no verdict
    when interactive alone was itself overloaded."""
    alone = by_name(summaries).get("alone", {})
    overloaded = plan.overload_reason(
        alone.get("interactive_busy"), alone.get("ttft_p50_s"), median_prefill_s
    )
    return plan.verdict(
        goals["ttft_p50_ratio"], goals["ttft_p99_ratio"], goals["batch_kept_a"], overloaded
    )
