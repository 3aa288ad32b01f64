"""Interactive protection: interactive time to first token while batch work shares the engine,
Backfill against vLLM's own priority scheduling and against fcfs, all in one run.

Interactive load: a request trace (``TIMESTAMP,ContextTokens,GeneratedTokens``; by default
rows 201-2,200 of the Azure code trace bundled in ``backfill_analysis/traces/``; prompts clipped
to 1,500 tokens, outputs to 64 exactly) replayed open loop, streaming, at priority 0. Its
arrivals are stretched so that interactive alone keeps the engine ~30% busy on *this* machine:
a short probe measures the engine's prefill and decode speed first, and the stretch is sized
from it (:mod:`bench.protection.plan`; ``--time-scale`` fixes it instead). The share of the
window interactive alone kept the engine busy is printed; when interactive alone was itself
overloaded the run gives no verdict. Batch load: summarisation chat requests (~475 prompt
tokens, 64 out) that keep the engine busy. Scenarios:

``alone``           interactive straight to vLLM, nothing else (the baseline)
``gateway``         interactive through Backfill's gateway, nothing else
``batch-straight``  batch alone, straight to vLLM at concurrency 32, priority 10
``batch-backfill``  batch alone, as a Backfill job run by a Backfill worker
``a``               Backfill: interactive through the gateway + the Backfill batch job
``b``               batch straight (concurrency 32, priority 10) + interactive straight
``c``               as ``b`` on a second server started with ``--scheduling-policy fcfs``
``alone-sched``     as ``alone`` on the Backfill engine, with ``--scheduler-cls`` only

The peers (``alone``, ``b``, ``batch-straight``) run on a stock priority server, ``c`` on an
fcfs one; the Backfill scenarios (``gateway``, ``batch-backfill``, ``a``) and ``alone-sched``
run on a server of their own with Backfill's step scheduler (its metrics handed to the
worker), or with ``--scheduler-cls NAME``; ``--scheduler-cls none`` runs them on the stock
server too (the work budget then preempts for TTFT, as before the scheduler).
Each batch scenario first lets the batch load run for a warm-up, then the measured window is
the interactive replay (or, for batch alone, the same length of time). Batch output tokens/s
is the engine's ``vllm:generation_tokens_total`` over the window less the interactive
requests' own tokens, so every scenario is counted the same way.

``a`` runs once per ``--variant NAME:KEY=VALUE,...`` (settings overrides given to the API and
the worker as ``BACKFILL_*`` variables; the first variant is the headline), so a sweep of
admission settings gives a curve of batch throughput against interactive TTFT p99, e.g.::

    python -m bench.protection --scenarios alone,batch-backfill,a \
        --variant budget --variant off:work_budget_enabled=false \
        --variant target2s:interactive_ttft_target_s=2

Each variant gets a fresh API, worker, scratch database and ledger namespace on the same
engine; ``goals`` in ``bench/out/protection.json`` has each variant's TTFT p99 ratio and the
share of standalone batch throughput it kept.

The closing line judges the headline ``a`` on all three goals at once: TTFT p50 and p99 <=
1.1x of interactive alone and batch kept >= 0.6 of Backfill's batch alone; its figure is the
worst of p50/1.1, p99/1.1 and 0.6/kept (ok at <= 1). Beside it: recomputed batch tokens as a
share of the batch tokens the engine processed, and interactive ITL p99 against alone.

This module is the command line; the run is in :mod:`bench.protection.run` (engines, load,
variants), one scenario in :mod:`bench.protection.scenario`, what it measured in
:mod:`bench.protection.record`, the report and goals in :mod:`bench.protection.report` and the
pure sizing and verdict in :mod:`bench.protection.plan`.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

from backfill_analysis.simulate.trace import AZURE_CODE_TRACE, TraceOptions, load_trace
from bench.common import OUT_DIR, finish, machine, parser, table
from bench.protection import plan
from bench.protection.pairs import report as pairs_report
from bench.protection.record import Config, Variant, parse_variant, say
from bench.protection.report import (
    HEADERS,
    by_name,
    closing_verdict,
    fmt,
    plot,
    rows,
    tradeoff_points,
    verdicts,
)
from bench.protection.run import DEFAULT_SCENARIOS, SCENARIOS, run_all
from bench.protection.split import split_table
from devkit import devengine

NAME = "protection"
TRACE = AZURE_CODE_TRACE
# The default trace's first 200 rows are one burst; the next 2,000 (18:20:23-18:31:25) are the
# replayed slice.
TRACE_SKIP, TRACE_ROWS = 200, 2000
PLOT = Path(__file__).parent / "protection.png"
GOAL_TTFT_RATIO = plan.GOAL_TTFT_RATIO
GOAL_BATCH_KEPT = plan.GOAL_BATCH_KEPT


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny (smoke test)")
    p.add_argument("--trace", type=Path, default=TRACE, help="a TIMESTAMP,ContextTokens,"
                   f"GeneratedTokens CSV (default the bundled {TRACE.name})")  # fmt: skip
    p.add_argument(
        "--skip",
        type=int,
        default=None,
        help=f"trace rows to skip (default {TRACE_SKIP} of the bundled trace, else 0)",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help=f"trace rows to keep after those (default {TRACE_ROWS} of the bundled trace, "
        "else all)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="stretch arrivals by this much (default: sized from the probed engine so that "
        "interactive alone keeps it --target-busy busy)",
    )
    p.add_argument(
        "--target-busy",
        type=float,
        default=plan.TARGET_BUSY,
        help=f"share of the window interactive alone keeps the engine busy ({plan.TARGET_BUSY})",
    )
    p.add_argument("--max-prompt", type=int, default=1500, help="clip prompts (1500 tokens)")
    p.add_argument("--max-output", type=int, default=64, help="clip outputs (64 tokens)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of (scaled) trace per scenario; default 90, --quick 30",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds the batch runs before the window (default 10, --quick 5)",
    )
    p.add_argument("--concurrency", type=int, default=32, help="straight batch concurrency")
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument(
        "--scheduler-cls",
        default=devengine.SCHEDULER_CLS,
        metavar="NAME",
        help="vLLM --scheduler-cls for the engine the Backfill scenarios (and alone-sched) "
        "run on; the others stay on the stock engine (default: Backfill's step scheduler, "
        "its metrics handed to the worker; 'none': the stock engine for all)",
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all but a-direct "
        "and b-sched; alone-sched, a-direct and b-sched only with --scheduler-cls)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="run scenario a with these Backfill settings (repeatable; the first "
        "is the headline; default one variant 'default' with no overrides)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"PNG path (default {PLOT.name} beside this file; --quick or --scenarios: "
        "bench/out/protection-quick.png)",
    )
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the engines, the API and worker processes, the scratch
    # database and the ledger keys are all cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    default_scenarios = [
        s
        for s in DEFAULT_SCENARIOS
        if s != "alone-sched" or args.scheduler_cls not in (None, "none")
    ]
    chosen = args.scenarios or ",".join(default_scenarios)
    wanted = [s.strip() for s in chosen.split(",") if s.strip()]
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    variants = [parse_variant(v) for v in args.variant] or [Variant("default", {})]
    duration = args.duration or (30.0 if args.quick else 90.0)
    # Unstretched and unwindowed: the stretch is sized once the engine's speed is known.
    bundled = args.trace == TRACE
    options = TraceOptions(
        max_prompt_tokens=args.max_prompt,
        max_output_tokens=args.max_output,
        skip=args.skip if args.skip is not None else (TRACE_SKIP if bundled else 0),
        rows=args.rows if args.rows is not None else (TRACE_ROWS if bundled else None),
    )
    trace = load_trace(args.trace, options)
    if not trace:
        raise SystemExit(f"no requests in {args.trace} with {options}")
    cfg = Config(
        model=args.model,
        trace=options,
        trace_path=args.trace,
        warmup_s=args.warmup if args.warmup is not None else (5.0 if args.quick else 10.0),
        concurrency=args.concurrency,
        batch_priority=10,
        batch_prompt_chars=1700,
        batch_max_tokens=64,
        kv_cache_gib=args.kv_cache_gib,
        duration_s=duration,
        time_scale=args.time_scale,
        target_busy=args.target_busy,
        scheduler_cls=None if args.scheduler_cls in (None, "none") else args.scheduler_cls,
        batch_window_s=60.0 if args.quick else 90.0,
    )
    say(
        f"trace {args.trace.name}: {len(trace)} requests over {trace[-1].arrival_s:.0f} s, "
        f"mean prompt {statistics.fmean(r.prompt_tokens for r in trace):.0f}, mean output "
        f"{statistics.fmean(r.output_tokens for r in trace):.1f} tokens (clipped)"
    )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    logs = OUT_DIR / "protection-logs"
    results, starts, load = run_all(cfg, trace, wanted, variants, logs)
    summaries = [r.summary() for r in results]
    print(table(HEADERS, rows(summaries)))
    goals = verdicts(summaries)
    for key, value in goals.items():
        print(f"{key}: {fmt(value, 3) if isinstance(value, float) else value}")
    alone = by_name(summaries).get("alone", {})
    busy = alone.get("interactive_busy")
    print(
        f"interactive load: x{load.stretch.time_scale:.3g} stretch, "
        f"{len(load.requests)} requests, planned busy {load.stretch.planned_busy:.0%}, reached "
        + (f"{busy:.0%}" if busy is not None else "— (alone not run)")
        + f" (engine: {load.speed})"
    )
    # Only a full run draws the committed plot; a quick run or a subset of scenarios would
    # draw over it with a partial picture.
    partial = args.quick or args.scenarios is not None
    plot_path = args.plot or (OUT_DIR / "protection-quick.png" if partial else PLOT)
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(
        summaries,
        plot_path,
        f"Interactive protection, {cfg.model} on vLLM CPU, {duration:.0f} s of trace per "
        f"scenario (x{load.stretch.time_scale:.3g}), {machine()}",
    )
    print(f"plot: {plot_path}")
    for other in ("a", "a-direct", "b-sched"):
        paired = pairs_report(summaries, other)
        if paired is not None:
            print(paired)
    split = split_table(summaries)
    if split is not None:
        print(split)
    command = "python -m bench.protection " + " ".join(sys.argv[1:] if argv is None else argv)
    judged = closing_verdict(summaries, goals, load.median_prefill_s())
    print(
        "goals (a): TTFT p50 and p99 <= "
        f"{GOAL_TTFT_RATIO}x alone, batch kept >= {GOAL_BATCH_KEPT}: p50 "
        f"{fmt(goals['ttft_p50_ratio'])}x, p99 {fmt(goals['ttft_p99_ratio'])}x, kept "
        f"{fmt(goals['batch_kept_a'])}; beside: recomputed "
        + (f"{goals['recomputed_share_a']:.1%}" if goals["recomputed_share_a"] is not None else "—")
        + f" of batch tokens processed, ITL p99 {fmt(goals['itl_p99_ratio'])}x alone"
    )
    finish(
        NAME,
        "worst_goal_share",
        judged.worst,
        "<=",
        1.0,
        {
            "command": command.strip(),
            "started": started,
            "loadavg_at_start": load_start,
            "loadavg_at_end": os.getloadavg(),
            "engine_ready_seconds": starts,
            "config": asdict(cfg) | {"trace_path": str(cfg.trace_path)},
            "engine_speed": asdict(load.speed),
            "time_scale": load.stretch.time_scale,
            "time_scale_sized": load.stretch.sized,
            "planned_busy": load.stretch.planned_busy,
            "reached_busy": busy,
            "variants": [asdict(v) for v in variants],
            "interactive_requests": len(load.requests),
            "goals": goals,
            "verdict": asdict(judged),
            "goal_ttft_ratio": GOAL_TTFT_RATIO,
            "goal_batch_kept": GOAL_BATCH_KEPT,
            "tradeoff": tradeoff_points(summaries),
            "plot": str(plot_path),
            "scenarios": summaries,
        },
        reason=judged.reason,
    )


if __name__ == "__main__":
    main()
