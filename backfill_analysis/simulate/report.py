"""A comparison as a table, a JSON record and plots."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from backfill_analysis.simulate import plots
from backfill_analysis.simulate.compare import Comparison, best_at_slo
from backfill_analysis.simulate.metrics import PolicyResult

Curves = dict[str, list[tuple[float, PolicyResult]]]


def _fmt(v: object) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if not math.isfinite(v):
            return "inf"
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    headers = list(rows[0])
    cells = [[_fmt(r[h]) for h in headers] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = [
        "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def results_rows(comparison: Comparison) -> list[dict[str, Any]]:
    base = comparison.baselines
    return [
        {**r.row(), "harvest": base.harvest(r), "overall_x": base.overall_gain(r)}
        for r in comparison.results
    ]


def equal_slo_rows(
    curves: Curves, target: float, comparison: Comparison | None, ttft_target_s: float | None = None
) -> list[dict[str, Any]]:
    """Per policy: its best knob setting at SLO attainment >= target (at ``ttft_target_s``,
    default each run's own TTFT target)."""
    rows = []
    for name, points in curves.items():
        best = best_at_slo(points, target, ttft_target_s)
        if best is None:
            rows.append(
                {
                    "policy": name,
                    "knob": "-",
                    "slo": float("nan"),
                    "batch_tok_s": 0.0,
                    "harvest": 0.0,
                    "overall_x": 0.0,
                }
            )
            continue
        value, result = best
        harvest = comparison.baselines.harvest(result) if comparison else float("nan")
        overall = comparison.baselines.overall_gain(result) if comparison else float("nan")
        slo = result.slo_attainment if ttft_target_s is None else result.attainment(ttft_target_s)
        rows.append(
            {
                "policy": name,
                "knob": value,
                "slo": slo,
                "batch_tok_s": result.batch_tokens_per_s,
                "harvest": harvest,
                "overall_x": overall,
            }
        )
    return rows


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write(
    comparison: Comparison,
    out_dir: Path,
    *,
    curves: Curves | None = None,
    slo_target: float = 0.99,
    plot: bool = True,
    tradeoff_ttft_s: Sequence[float] = (),
) -> dict[str, Path]:
    """``simulate.json`` and, with ``plot``, the PNGs; returns what was written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sc = comparison.scenario
    base = comparison.baselines
    record: dict[str, Any] = {
        "scenario": sc.name,
        "duration_s": sc.duration_s,
        "ttft_slo_s": sc.ttft_slo_s,
        "engine": {
            "num_blocks": sc.engine.num_blocks,
            "block_size": sc.engine.block_size,
            "max_num_batched_tokens": sc.engine.max_num_batched_tokens,
            "max_num_seqs": sc.engine.max_num_seqs,
            "cost": sc.engine.cost.to_json(),
        },
        "knobs": asdict(sc.knobs),
        "interactive_requests": comparison.interactive,
        "batch_items": comparison.batch_items,
        "baselines": {
            "interactive_alone": base.interactive_alone.to_json(),
            "batch_alone": base.batch_alone.to_json(),
            "slack_tokens_per_s": base.slack_tokens_per_s,
        },
        "results": [
            {**r.to_json(), "harvest": base.harvest(r), "overall_gain": base.overall_gain(r)}
            for r in comparison.results
        ],
    }
    if curves:
        record["sweeps"] = {
            name: [{"knob": v, **r.row()} for v, r in points] for name, points in curves.items()
        }
        record["equal_slo"] = equal_slo_rows(curves, slo_target, comparison)
    paths = {"json": out_dir / "simulate.json"}
    paths["json"].write_text(json.dumps(_clean(record), indent=2, default=str) + "\n")
    if plot:
        paths["kv"] = plots.kv_over_time(
            comparison.results, sc.engine.num_blocks, out_dir / "kv_pool_over_time.png"
        )
        paths["ttft"] = plots.ttft_cdf(comparison.results, sc.ttft_slo_s, out_dir / "ttft_cdf.png")
        if curves:
            paths["tradeoff"] = plots.throughput_vs_slo(
                curves, slo_target, out_dir / "batch_throughput_vs_slo.png"
            )
            for ttft in tradeoff_ttft_s:
                paths[f"tradeoff@{ttft:g}s"] = plots.throughput_vs_slo(
                    curves, slo_target, out_dir / f"batch_throughput_vs_slo_ttft{ttft:g}s.png", ttft
                )
    return paths
