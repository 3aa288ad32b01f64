"""The simulator's speed, and the policies' results on the trace.

    python -m bench.simulate [--quick] [--sweep]

Times one comparison: an hour of the Azure code trace (one node's share) plus 100,000 batch
items, through every policy and the two baselines (interactive alone, batch alone), on one
core. The peer is the wall-clock budget itself (goal <= 60 s). ``--quick`` simulates ten
minutes and a sixth of the items. ``--sweep`` then runs each policy across its knob (not
timed) and reports batch throughput at equal interactive SLO attainment.
"""

from __future__ import annotations

import dataclasses
import math
import sys

from backfill_analysis.simulate import compare, report
from backfill_analysis.simulate.scenario import scenario
from backfill_analysis.simulate.trace import AZURE_CODE_TRACE
from bench.common import OUT_DIR, Stopwatch, finish, machine, parser

TRACE = str(AZURE_CODE_TRACE)
GOAL_S = 60.0


def main(argv: list[str] | None = None) -> int:
    p = parser("simulate", __doc__ or "")
    p.add_argument("--sweep", action="store_true", help="knob sweeps at equal SLO attainment")
    p.add_argument("--trace", default=TRACE)
    args = p.parse_args(argv)
    sc = scenario("h100-llama-3.1-8b")
    if args.quick:
        sc = dataclasses.replace(
            sc, duration_s=600.0, batch=dataclasses.replace(sc.batch, items=16_667)
        )
    print(f"machine: {machine()}")
    with Stopwatch() as sw:
        result = compare.compare(sc, args.trace)
    print(
        f"{sc.name}: {result.interactive} interactive requests, {result.batch_items:,} batch "
        f"items, {sc.duration_s:,.0f} s simulated, TTFT target {sc.ttft_slo_s:g} s"
    )
    print(report.table(report.results_rows(result)))
    base = result.baselines
    print(
        f"baselines: interactive alone TTFT p99 {base.interactive_alone.ttft_p99_s:.3f} s, "
        f"SLO {base.interactive_alone.slo_attainment:.2%}, busy "
        f"{base.interactive_alone.busy_s / sc.duration_s:.1%}; batch alone "
        f"{base.batch_alone.batch_tokens_per_s:,.0f} tok/s; slack capacity "
        f"{base.slack_tokens_per_s:,.0f} tok/s"
    )
    curves = None
    tight = math.ceil(base.interactive_alone.ttft_p99_s * 10) / 10
    equal: dict[str, list[dict[str, object]]] = {}
    if args.sweep:
        curves = compare.sweep(sc, args.trace)
        # Also the tightest target interactive alone meets for 99% of requests: there any
        # interference batch causes shows.
        for target in (sc.ttft_slo_s, tight):
            rows = report.equal_slo_rows(curves, 0.99, result, target)
            equal[f"ttft<={target:g}s"] = rows
            print(f"best setting per policy at >= 99% of requests with TTFT <= {target:g} s:")
            print(report.table(rows))
    paths = report.write(result, OUT_DIR / "simulate", curves=curves, tradeoff_ttft_s=(tight,))
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    details = {
        "scenario": sc.name,
        "simulated_s": sc.duration_s,
        "batch_items": result.batch_items,
        "interactive_requests": result.interactive,
        "results": report.results_rows(result),
    }
    if equal:
        details["equal_slo"] = equal
    ok = finish("simulate", "seconds", sw.seconds, "<=", GOAL_S, details)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
