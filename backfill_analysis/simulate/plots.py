"""Pictures of a comparison (PNG, matplotlib's headless Agg backend).

matplotlib loads only when a plot is drawn, so the simulator itself needs nothing beyond the
standard library.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from backfill_analysis.simulate.metrics import PolicyResult


def _pyplot() -> Any:
    import matplotlib  # noqa: PLC0415 - optional, heavy; only for drawing

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def kv_over_time(results: Sequence[PolicyResult], num_blocks: int, path: Path) -> Path:
    """The pool over time, stacked by class, one panel per policy."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(results), 1, figsize=(10, 2.2 * len(results)), sharex=True, squeeze=False
    )
    for ax, result in zip(axes[:, 0], results, strict=True):
        t = [s.t / 60 for s in result.kv_timeline]
        inter = [s.interactive / num_blocks for s in result.kv_timeline]
        batch = [s.batch / num_blocks for s in result.kv_timeline]
        ax.stackplot(
            t,
            inter,
            batch,
            labels=["interactive", "batch"],
            colors=["#d62728", "#1f77b4"],
            alpha=0.8,
        )
        ax.set_ylim(0, 1)
        ax.set_ylabel("pool share")
        ax.set_title(result.policy, fontsize=9, loc="left")
    axes[0, 0].legend(loc="upper right", fontsize=8)
    axes[-1, 0].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_cdf(results: Sequence[PolicyResult], slo_s: float, path: Path) -> Path:
    """Time to first token, cumulative, per policy (log time axis)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for result in results:
        values = sorted(v for v in result.ttfts if math.isfinite(v) and v > 0)
        if not values:
            continue
        n = len(result.ttfts)
        ax.step(
            values, [(i + 1) / n for i in range(len(values))], where="post", label=result.policy
        )
    ax.axvline(slo_s, color="grey", linestyle="--", label=f"TTFT target {slo_s:g} s")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of interactive requests")
    ax.set_ylim(0, 1.01)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def throughput_vs_slo(
    curves: dict[str, list[tuple[float, PolicyResult]]],
    target: float,
    path: Path,
    ttft_target_s: float | None = None,
) -> Path:
    """Batch throughput against interactive SLO attainment (at ``ttft_target_s``, default
    each run's own target), one curve per policy across its knob."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))

    def slo(result: PolicyResult) -> float:
        return result.slo_attainment if ttft_target_s is None else result.attainment(ttft_target_s)

    for name, points in curves.items():
        ordered = sorted(points, key=lambda p: slo(p[1]))
        xs = [slo(p[1]) * 100 for p in ordered]
        ys = [p[1].batch_tokens_per_s for p in ordered]
        ax.plot(xs, ys, marker="o", label=name)
    ax.axvline(target * 100, color="grey", linestyle="--", label=f"{target * 100:g}% SLO")
    shown = "" if ttft_target_s is None else f" (TTFT <= {ttft_target_s:g} s)"
    ax.set_xlabel(f"interactive TTFT SLO attainment{shown} (%)")
    ax.set_ylabel("batch output tokens/s")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
