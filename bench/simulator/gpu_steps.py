"""Step times measured on a real GPU, and what they make of Backfill's step scheduler against
vLLM's priority scheduling: how much batch each keeps with interactive time to first token
within 1.1x of interactive alone.

    python -m bench.gpu_steps [--quick] [--steps FILE [--write]]

The step times are ``bench.gpu_step_times``' (run where a GPU is lent: a decoder of
Llama-3.1-8B's exact shape, random bfloat16 weights, each step shape timed as a CUDA graph),
stored with their fit in ``backfill_analysis/simulate/calibration/h200-llama-3.1-8b-torch.json``;
``--steps`` fits a new measurement instead, ``--write`` stores it. The benchmark

1. fits the simulator's cost model to them (``fit_cost_model``) and sets the fit, the H100
   and H200 roofline models beside every measured step;
2. runs the simulator's ``h200-llama-3.1-8b`` scenario (an hour of the Azure code trace's
   share of one node, 100,000 batch items; ``--quick`` ten minutes and a sixth of them) on the
   measured step times, in the same run: interactive alone, batch alone, Backfill's step
   scheduler (``backfill-step``) across its chunk target and the peer, vLLM's own priority
   scheduling with batch at a lower priority (``priority``), across its batch concurrency;
   each point's TTFT p50 and p99 and ITL p99 over alone's, and batch kept (over batch alone).

Both sides run as vLLM runs on a GPU, with async scheduling (each step scheduled while the one
before it runs: an arrival waits for the step in flight and the one already scheduled;
``--sync`` drops it), and Backfill's step scheduler with its whole-step bound for
``--likely`` seconds after interactive work (2, the class's default; 0 turns it off). Within
that window, with no interactive work in the engine, Backfill holds a batch-only step back
rather than schedule it ahead of the one in flight (the class's default; ``--ahead`` schedules
every step ahead, as vLLM does). A step not scheduled ahead (every step under ``--sync``, the
first after an idle spell, one held back) first idles the device for the host's share of a
step, ``--host-gap-ms`` (2 ms: scheduling, input preparation and output processing, which
async scheduling hides; published figures for vLLM are 1-5 ms a step), on both sides.

Then the idle-ready lever (``--no-idle`` skips it), as ``backfill-step+idle``: while
interactive work is in the engine and for ``idle_ready_s`` after, batch sits steps out (the
engine class's own rule, ``backfill_vllm.policy.idle_ready``, handed to the simulator), so
interactive work runs alone and the next arrival of a burst finds the engine idle; past that
window the cap is lifted to a step target (the class's ``lift_cap_after_s`` = the window,
``lifted_step_target_s``), so batch makes up in long steps between bursts what it gives up in
them, and those steps are held back (not scheduled ahead) for ``interactive_likely_s`` (10 s)
after interactive work. Each (window, lifted target, starvation bound ``starvation_s``) of
``IDLE_GRID`` (the bound relieves paused batch in the middle of a long burst, so it sets
interactive p99 here); then the Pareto front of (kept, p50, p99) over every Backfill point,
each beside vLLM priority at the same batch kept (interpolated along its curve).

Ends with ``gpu_steps: kept_at_1.05x=<the most batch kept by a Backfill setting with TTFT
p50 and p99 within 1.05x of alone> (goal >= 0.6)``; the peer's best under the same bound, and
both at 1.1x, are printed above it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from backfill_analysis.simulate import compare
from backfill_analysis.simulate.costmodel import CALIBRATION_DIR, CostModel
from backfill_analysis.simulate.scenario import Scenario, h100_cost, h200_llama8b
from backfill_analysis.simulate.trace import AZURE_CODE_TRACE
from backfill_vllm.policy import idle_ready
from bench.common import finish, machine, parser, table
from bench.simulator.gpu_fit import fit, step_work

NAME = "gpu_steps"
TTFT_GOAL = 1.05
LOOSER_GOAL = 1.1
KEPT_GOAL = 0.6
# The curves: Backfill's batch prefill per step (s) and the peer's batch concurrency.
KNOBS = {
    "backfill-step": (0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.05),
    "priority": (4, 8, 16, 32, 64, 128, 256),
}
QUICK_KNOBS = {"backfill-step": (0.003, 0.005, 0.01), "priority": (8, 16, 64)}
# The idle-ready lever: (idle window = lift after, s; lifted step target, s; starvation
# bound, s). The chunk target matters little there (only the starvation bound's chunks are
# capped by it): one value; batch-only steps are held back for IDLE_LIKELY_S after
# interactive work.
IDLE_GRID = tuple(
    (window, lifted, starvation)
    for window in (1.0, 2.0)
    for lifted in (0.01, 0.02, 0.05)
    for starvation in (1.0, 3.0, 10.0)
)
QUICK_IDLE_GRID = ((1.0, 0.02, 3.0), (2.0, 0.02, 3.0))
IDLE_CHUNK = 0.003
IDLE_LIKELY_S = 10.0
STORED = CALIBRATION_DIR / "h200-llama-3.1-8b-torch.json"
PEER, BACKFILL, IDLE = "priority", "backfill-step", "backfill-step+idle"


def step_rows(measured: dict[str, Any], model: CostModel) -> list[list[Any]]:
    h100, h200 = h100_cost(), h100_cost(gpu="h200")
    rows = []
    for s in measured["steps"]:
        if s.get("graph_s") is None:  # not fitted: say why, every column filled
            said = "failed" if "error" in s else "no graph"
            rows.append([s["prefill"], s["start"], s["decodes"], s["context"], said, *"----"])
            continue
        work = step_work(s)
        rows.append(
            [
                s["prefill"],
                s["start"],
                s["decodes"],
                s["context"],
                s["eager_s"] * 1000,
                s["graph_s"] * 1000,
                model.step_seconds(work) * 1000,
                h200.step_seconds(work) * 1000,
                h100.step_seconds(work) * 1000,
            ]
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--steps", help="a bench.gpu_step_times output (or a stored fit's file) to fit")
    p.add_argument("--write", action="store_true", help=f"store the fit in {STORED.name}")
    p.add_argument("--sync", action="store_true", help="without vLLM's async scheduling")
    p.add_argument(
        "--ahead",
        action="store_true",
        help="schedule every step ahead, also batch-only ones while interactive is likely",
    )
    p.add_argument(
        "--host-gap-ms",
        type=float,
        default=2.0,
        help="host time of a step not scheduled ahead, ms (2)",
    )
    p.add_argument(
        "--likely",
        type=float,
        default=2.0,
        help="the whole-step bound's window after interactive work, s (0: off)",
    )
    p.add_argument("--no-idle", action="store_true", help="skip the idle-ready lever's sweep")
    args = p.parse_args(argv)
    if args.write and not args.steps:
        p.error("--write stores a new fit: give --steps")
    if args.steps:
        measured = json.loads(Path(args.steps).read_text())
        measured = measured.get("measured", measured)  # a stored fit's file holds its steps
        model, error = fit(measured)
        if args.write:
            stored = {
                "model": model.to_json(),
                "fit_rms_relative_error": error,
                "fitted": datetime.now(UTC).isoformat(timespec="seconds"),
                "how": __doc__,
                "measured": measured,
            }
            STORED.write_text(json.dumps(stored, indent=1) + "\n")
            print(f"stored {STORED}")
    else:
        stored = json.loads(STORED.read_text())
        measured = stored["measured"]
        model, error = CostModel.from_json(stored["model"]), stored["fit_rms_relative_error"]
    env = measured["environment"]
    print(f"machine: {machine()}; steps timed on {env['device']}, PyTorch {env['torch']}")
    print(
        table(
            [
                "prefill",
                "after",
                "decodes",
                "context",
                "eager_ms",
                "graph_ms",
                "fit_ms",
                "h200_roofline",
                "h100_roofline",
            ],
            step_rows(measured, model),
        )
    )
    print(
        f"fit: a={model.step_overhead_s * 1e3:.2f} ms, b={model.per_prefill_token_s * 1e6:.2f} "
        f"us/prompt token, d={model.per_prefill_attention_s * 1e9:.3f} ns/attention pair, "
        f"c={model.per_decode_token_s * 1e6:.2f} us/decoding sequence, "
        f"e={model.per_decode_context_s * 1e9:.2f} ns/context token; RMS relative error "
        f"{error:.1%}"
    )

    sc = h200_llama8b(model)
    sc = dataclasses.replace(
        sc,
        engine=dataclasses.replace(
            sc.engine, async_scheduling=not args.sync, host_gap_s=args.host_gap_ms / 1000
        ),
        knobs=dataclasses.replace(
            sc.knobs,
            step_schedule=dataclasses.replace(
                sc.knobs.step_schedule,
                interactive_likely_s=args.likely,
                ahead_while_likely=args.ahead,
            ),
        ),
    )
    if args.quick:
        sc = dataclasses.replace(
            sc, duration_s=600.0, batch=dataclasses.replace(sc.batch, items=16_667)
        )
    knobs = QUICK_KNOBS if args.quick else KNOBS
    trace = str(AZURE_CODE_TRACE)
    curves = compare.sweep(sc, trace, policies=(BACKFILL, PEER), values=knobs)
    base = compare.baselines(sc, *compare.workload(sc, trace, 0))
    alone, batch_alone = base.interactive_alone, base.batch_alone.batch_tokens_per_s
    print(
        f"{sc.name}: {sc.duration_s:,.0f} s simulated, {sc.batch.items:,} batch items, "
        f"{sc.engine.num_blocks:,} blocks of {sc.engine.block_size}; interactive alone TTFT "
        f"p50/p99 {alone.ttft_p50_s * 1000:.1f}/{alone.ttft_p99_s * 1000:.1f} ms, ITL p99 "
        f"{alone.itl_p99_s * 1000:.1f} ms, engine busy "
        f"{alone.busy_s / alone.duration_s:.1%}; batch alone {batch_alone:,.0f} tokens/s"
    )
    labelled = [(name, f"{value:g}", r) for name, curve in curves.items() for value, r in curve]
    if not args.no_idle:
        for window, lifted, starvation in QUICK_IDLE_GRID if args.quick else IDLE_GRID:
            curve = compare.sweep(
                idle_ready_scenario(sc, window, lifted, starvation),
                trace,
                policies=(BACKFILL,),
                values={BACKFILL: (IDLE_CHUNK,)},
            )[BACKFILL]
            label = f"{window:g} lift {lifted:g} starve {starvation:g}"
            labelled += [(IDLE, label, r) for _, r in curve]
    rows, points = [], []
    for name, value, r in labelled:
        point = Point(
            name,
            "idle_ready_s" if name == IDLE else compare.SWEEPS[name][0],
            value,
            r.ttft_p50_s / alone.ttft_p50_s,
            r.ttft_p99_s / alone.ttft_p99_s,
            r.batch_tokens_per_s / batch_alone,
            base.harvest(r),
            r.itl_p99_s / alone.itl_p99_s,
        )
        points.append(point)
        rows.append(list(dataclasses.astuple(point)))
    print(
        table(["policy", "knob", "value", "p50_x", "p99_x", "kept", "harvest", "itl_p99_x"], rows)
    )
    batch_only = "scheduled ahead" if args.ahead else "held back"
    print(
        f"async scheduling {'off' if args.sync else 'on'}, whole-step bound for {args.likely:g} s "
        f"after interactive work, batch-only steps {batch_only} within it, host gap "
        f"{args.host_gap_ms:g} ms a step not scheduled ahead"
    )
    front = pareto([pt for pt in points if pt.policy != PEER])
    peer_curve = [pt for pt in points if pt.policy == PEER]
    print("Backfill's Pareto front (kept up, p50 and p99 down), vLLM priority at the same kept:")
    print(
        table(
            ["policy", "value", "kept", "p50_x", "p99_x", "priority_p50_x", "priority_p99_x"],
            [
                [pt.policy, pt.value, pt.kept, pt.p50_x, pt.p99_x, *at_kept(peer_curve, pt.kept)]
                for pt in front
            ],
        )
    )
    for goal in (LOOSER_GOAL, TTFT_GOAL):
        for name in (BACKFILL, IDLE, PEER):
            top = best(points, name, goal)
            said = (
                f"{top.knob}={top.value}: p50 {top.p50_x:.3f}x, p99 {top.p99_x:.3f}x, kept "
                f"{top.kept:.2f}"
                if top
                else "no setting"
            )
            print(f"{name}: most batch kept with p50 and p99 <= {goal}x of alone: {said}")
    ours = max(
        (pt for pt in (best(points, BACKFILL), best(points, IDLE)) if pt is not None),
        key=lambda pt: pt.kept,
        default=None,
    )
    peer = best(points, PEER)
    kept = ours.kept if ours else 0.0
    details = {
        "device": env["device"],
        "torch": env["torch"],
        "cost_model": model.to_json(),
        "fit_rms_relative_error": error,
        "scenario": sc.name,
        "async_scheduling": not args.sync,
        "interactive_likely_s": args.likely,
        "ahead_while_likely": args.ahead,
        "idle_ready_grid": None if args.no_idle else [list(g) for g in IDLE_GRID],
        "idle_ready_likely_s": IDLE_LIKELY_S,
        "pareto": [dataclasses.asdict(pt) for pt in front],
        "host_gap_s": args.host_gap_ms / 1000,
        "duration_s": sc.duration_s,
        "alone_ttft_p50_s": alone.ttft_p50_s,
        "alone_ttft_p99_s": alone.ttft_p99_s,
        "alone_itl_p99_s": alone.itl_p99_s,
        "batch_alone_tokens_per_s": batch_alone,
        "curve": [dataclasses.asdict(pt) for pt in points],
        "backfill_best": dataclasses.asdict(ours) if ours else None,
        "peer_best": dataclasses.asdict(peer) if peer else None,
    }
    finish(NAME, f"kept_at_{TTFT_GOAL}x", kept, ">=", KEPT_GOAL, details)
    return 0


@dataclasses.dataclass(frozen=True)
class Point:
    """One policy setting's result, against the baselines."""

    policy: str
    knob: str
    value: str
    p50_x: float
    p99_x: float
    kept: float
    """Batch tokens/s over batch alone's."""
    harvest: float
    """Batch tokens/s over the slack interactive alone leaves."""
    itl_p99_x: float
    """Interactive inter-token time p99 over alone's."""


def idle_ready_scenario(
    sc: Scenario, window_s: float, lifted_step_target_s: float, starvation_s: float
) -> Scenario:
    """``sc`` with the idle-ready lever: batch sits out while interactive work is in the engine
    and for ``window_s`` after (the engine class's rule) but for what ``starvation_s`` relieves;
    past it the cap lifts to ``lifted_step_target_s``, those steps held back for
    :data:`IDLE_LIKELY_S` after interactive work."""
    step = dataclasses.replace(
        sc.knobs.step_schedule,
        chunk_target_s=IDLE_CHUNK,
        idle_ready_s=window_s,
        idle_rule=idle_ready,
        lift_cap_after_s=window_s,
        lifted_step_target_s=lifted_step_target_s,
        interactive_likely_s=IDLE_LIKELY_S,
        starvation_s=starvation_s,
    )
    return dataclasses.replace(sc, knobs=dataclasses.replace(sc.knobs, step_schedule=step))


def pareto(points: list[Point]) -> list[Point]:
    """The points no other beats or equals on all of kept (more), p50 and p99 (less), most
    kept first."""

    def beats(a: Point, b: Point) -> bool:
        no_worse = a.kept >= b.kept and a.p50_x <= b.p50_x and a.p99_x <= b.p99_x
        return no_worse and (a.kept, a.p50_x, a.p99_x) != (b.kept, b.p50_x, b.p99_x)

    front = [p for p in points if not any(beats(q, p) for q in points)]
    return sorted(front, key=lambda p: -p.kept)


def at_kept(curve: list[Point], kept: float) -> tuple[float, float]:
    """(p50, p99) over alone's along ``curve`` at batch kept ``kept``: linear between its two
    points around it; nan beyond its ends."""
    ordered = sorted(curve, key=lambda p: p.kept)
    for lo, hi in itertools.pairwise(ordered):
        if lo.kept <= kept <= hi.kept:
            w = (kept - lo.kept) / (hi.kept - lo.kept) if hi.kept > lo.kept else 0.0
            return lo.p50_x + w * (hi.p50_x - lo.p50_x), lo.p99_x + w * (hi.p99_x - lo.p99_x)
    return math.nan, math.nan


def best(points: list[Point], policy: str, goal: float = TTFT_GOAL) -> Point | None:
    """``policy``'s setting that keeps the most batch with TTFT p50 and p99 within ``goal``."""
    meeting = [p for p in points if p.policy == policy and p.p50_x <= goal and p.p99_x <= goal]
    return max(meeting, key=lambda p: p.kept) if meeting else None


if __name__ == "__main__":
    sys.exit(main())
