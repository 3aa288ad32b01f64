"""Batch throughput: Backfill end to end vs ``vllm run-batch`` vs a direct asyncio client.

The same summarisation requests (chat, temperature 0, ``ignore_eos`` with a fixed
``max_tokens``, so every side generates exactly the same number of tokens) go through:

* **Backfill** — the real ``backfill api`` and ``backfill worker --beat`` processes against a
  vLLM server: upload the JSONL, then time ``POST /v1/batches`` until the batch is
  ``completed`` (output file written). Items done (all results durable) is reported too.
* **vllm run-batch** — vLLM's own batch runner, in-process engine, same engine flags; timed
  from the runner's own ``run_batch`` coroutine (read input, run every request, write output),
  so the engine's start is excluded. The whole process's wall time is reported beside it.
* **direct** — an ``httpx`` asyncio client posting non-streaming requests to the same vLLM
  server as Backfill, at the best concurrency of a short sweep.

Two models: ``smollm2`` (real 135M model; the engine is the bottleneck; goal >= 0.9x the best
peer) and ``tiny`` (random 459k-parameter model; queue overhead shows; goal >= 0.75x). Every
side and every round gets its own random prefix on every prompt, so vLLM's prefix cache never
helps anyone (the server's ``vllm:prefix_cache_hits_total`` is read to check). Sides alternate
order from round to round; figures are best-of with the spread (min-max) beside them, because
other engineers' engines and tests share these 2 cores.

With ``--step-scheduler`` a fourth side, ``backfill-step``, runs Backfill on a second engine of
the same flags started with Backfill's step scheduler (``backfill_vllm``, the worker reading its
metrics as in production), in the same alternating rounds: the ratio ``backfill-step /
backfill`` is what the scheduler costs batch alone (issue 18's goal: >= 0.98), and becomes the
closing line.

A full run uses 2,000 ``tiny`` requests (two rounds) and 240 ``smollm2`` requests (one round,
the peers' note's size): the real model makes ~125 tokens/s here on a quiet machine, so 2,000
of its requests would take ~17 minutes per side (``--requests`` overrides).

This module is the command line, one model's rounds and the report; the sides are in
:mod:`bench.throughput.sides`, the engine's flags and readings in :mod:`bench.throughput.engine`,
the requests and workloads in :mod:`bench.throughput.workload`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, finish, machine, parser, table
from bench.stack import BackfillStack
from bench.throughput.engine import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from bench.throughput.sides import THROUGHPUT_SETTINGS, run_backfill, run_direct, run_vllm_batch
from bench.throughput.workload import SIDES, STEP_GOAL, STEP_SIDE, SideRun, Workload, workloads
from devkit import devengine

NAME = "throughput"


PLOT = Path(__file__).parent / "throughput.png"


def say(message: str) -> None:
    print(f"[throughput] {message}", file=sys.stderr, flush=True)


def measure_model(w: Workload, logs: Path, step_scheduler: bool = False) -> dict[str, Any]:
    spec = devengine.MODELS[w.model]
    python, model_dir = devengine.provision(w.model)
    sides = (*SIDES, STEP_SIDE) if step_scheduler else SIDES
    runs: list[SideRun] = []
    sweep: dict[int, float] = {}
    flags: dict[str, Any] = {
        "kv_cache_gib": w.kv_cache_gib,
        "max_num_seqs": MAX_NUM_SEQS,
        "extra_args": ["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)],
    }
    with ExitStack() as stack:
        server = devengine.start_model(w.model, **flags)
        stack.callback(server.stop)
        backfill = stack.enter_context(
            BackfillStack(server.url, logs / w.model, THROUGHPUT_SETTINGS).running()
        )
        stepped: tuple[devengine.EngineServer, BackfillStack] | None = None
        if step_scheduler:
            step_server = devengine.start_model(w.model, scheduler=True, **flags)
            stack.callback(step_server.stop)
            assert step_server.scheduler_metrics_url is not None
            step_settings = {
                **THROUGHPUT_SETTINGS,
                "engine_scheduler_metrics_url": step_server.scheduler_metrics_url,
            }
            step_stack = BackfillStack(step_server.url, logs / f"{w.model}-step", step_settings)
            stepped = (step_server, stack.enter_context(step_stack.running()))
        for c in w.sweep:
            r = run_direct(server, w, spec.name, w.sweep_requests, c, -1)
            sweep[c] = r.tokens_per_s
            say(f"{w.model} sweep: direct c={c}: {r.tokens_per_s:,.0f} tok/s")
        best_c = max(sweep, key=lambda c: sweep[c])
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bftput-rb-")))
        for round_no in range(w.rounds):
            order = sides if round_no % 2 == 0 else tuple(reversed(sides))
            for side in order:
                if side == "backfill":
                    run = run_backfill(backfill, server, w, spec.name, round_no)
                elif side == STEP_SIDE and stepped is not None:
                    run = run_backfill(stepped[1], stepped[0], w, spec.name, round_no)
                    run.side = STEP_SIDE
                elif side == "run-batch":
                    run = run_vllm_batch(python, model_dir, w, round_no, workdir)
                else:
                    run = run_direct(server, w, spec.name, w.requests, best_c, round_no)
                runs.append(run)
                say(
                    f"{w.model} round {round_no} {side}: {run.seconds:.1f} s, "
                    f"{run.tokens_per_s:,.0f} tok/s, {run.output_tokens} tokens {run.extra}"
                )
    return summarise(w, runs, sweep, best_c, sides)


def summarise(
    w: Workload,
    runs: list[SideRun],
    sweep: dict[int, float],
    best_c: int,
    side_names: Sequence[str] = SIDES,
) -> dict[str, Any]:
    expected = w.requests * w.max_tokens
    sides: dict[str, dict[str, Any]] = {}
    for side in side_names:
        mine = [r for r in runs if r.side == side]
        rates = [r.tokens_per_s for r in mine]
        best = max(mine, key=lambda r: r.tokens_per_s)
        sides[side] = {
            "best_tokens_per_s": best.tokens_per_s,
            "median_tokens_per_s": statistics.median(rates),
            "min_tokens_per_s": min(rates),
            "max_tokens_per_s": max(rates),
            "best_seconds": best.seconds,
            "output_tokens": sorted({r.output_tokens for r in mine}),
            "mean_prompt_tokens": best.prompt_tokens / best.requests,
            "best_tokens_per_cpu_s": max(r.tokens_per_cpu_s for r in mine),
        }
    mismatched = [asdict(r) for r in runs if r.output_tokens != expected]
    peer = max(sides["run-batch"]["best_tokens_per_s"], sides["direct"]["best_tokens_per_s"])
    peer_median = max(
        sides["run-batch"]["median_tokens_per_s"], sides["direct"]["median_tokens_per_s"]
    )
    step: dict[str, float] = {}
    if STEP_SIDE in sides:
        step = {
            "ratio_best": sides[STEP_SIDE]["best_tokens_per_s"]
            / sides["backfill"]["best_tokens_per_s"],
            "ratio_median": sides[STEP_SIDE]["median_tokens_per_s"]
            / sides["backfill"]["median_tokens_per_s"],
        }
    return {
        "model": w.model,
        "workload": asdict(w),
        "side_names": list(side_names),
        "step_scheduler": step,
        "expected_output_tokens": expected,
        "token_counts_match": not mismatched,
        "sides": sides,
        "direct_sweep_tokens_per_s": sweep,
        "direct_best_concurrency": best_c,
        "ratio_best": sides["backfill"]["best_tokens_per_s"] / peer,
        "ratio_median": sides["backfill"]["median_tokens_per_s"] / peer_median,
        "ratio_per_cpu_s": sides["backfill"]["best_tokens_per_cpu_s"]
        / max(
            sides["run-batch"]["best_tokens_per_cpu_s"], sides["direct"]["best_tokens_per_cpu_s"]
        ),
        "runs": [
            asdict(r) | {"tokens_per_s": r.tokens_per_s, "tokens_per_cpu_s": r.tokens_per_cpu_s}
            for r in runs
        ],
    }


# ---------------------------------------------------------------------------------------------
# Report


def _rows(results: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for res in results:
        w = res["workload"]
        for side in res["side_names"]:
            s = res["sides"][side]
            label = f"direct c={res['direct_best_concurrency']}" if side == "direct" else side
            rows.append(
                (
                    res["model"],
                    label,
                    w["requests"],
                    f"{s['mean_prompt_tokens']:.0f}/{w['max_tokens']}",
                    s["best_seconds"],
                    s["best_tokens_per_s"],
                    f"{s['min_tokens_per_s']:,.0f}-{s['max_tokens_per_s']:,.0f}",
                    ",".join(str(t) for t in s["output_tokens"]),
                    s["best_tokens_per_cpu_s"],
                )
            )
        rows.append(
            (
                res["model"],
                "Backfill / best peer",
                "",
                "",
                "",
                res["ratio_best"],
                f"median {res['ratio_median']:.3f}",
                f"goal >= {w['goal']}",
                res["ratio_per_cpu_s"],
            )
        )
        if res["step_scheduler"]:
            rows.append(
                (
                    res["model"],
                    "step scheduler / stock (Backfill)",
                    "",
                    "",
                    "",
                    res["step_scheduler"]["ratio_best"],
                    f"median {res['step_scheduler']['ratio_median']:.3f}",
                    f"goal >= {STEP_GOAL}",
                    "",
                )
            )
    return rows


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - plotting loads only when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4))
    axes_list = list(axes) if len(results) > 1 else [axes]
    colours = {
        "backfill": "#2b6cb0",
        STEP_SIDE: "#2c7a7b",
        "run-batch": "#718096",
        "direct": "#a0aec0",
    }
    for ax, res in zip(axes_list, results, strict=True):
        names, best, low, high = [], [], [], []
        for side in res["side_names"]:
            s = res["sides"][side]
            names.append(
                f"direct\nc={res['direct_best_concurrency']}" if side == "direct" else side
            )
            best.append(s["best_tokens_per_s"])
            low.append(s["best_tokens_per_s"] - s["min_tokens_per_s"])
            high.append(0.0)
        ax.bar(
            names, best, color=[colours[s] for s in res["side_names"]], yerr=[low, high], capsize=4
        )
        for x, v in enumerate(best):
            ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
        w = res["workload"]
        ax.set_title(
            f"{res['model']}: {w['requests']} requests x {w['max_tokens']} tokens\n"
            f"Backfill / best peer = {res['ratio_best']:.2f} (goal >= {w['goal']})",
            fontsize=10,
        )
        ax.set_ylabel("output tokens/s (best of rounds; bar down to worst)")
    fig.suptitle(f"Batch throughput, vLLM CPU, {machine()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument(
        "--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2 (default both)"
    )
    p.add_argument("--rounds", type=int, default=None, help="override rounds per model")
    p.add_argument("--requests", type=int, default=None, help="override requests per model")
    p.add_argument(
        "--step-scheduler",
        action="store_true",
        help="add the backfill-step side (Backfill on an engine running its step scheduler) "
        "and close on its ratio to Backfill on the stock engine",
    )
    args = p.parse_args(argv)
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    chosen: list[Workload] = []
    for w in workloads(args.quick):
        if w.model not in wanted:
            continue
        overrides: dict[str, Any] = {}
        if args.rounds:
            overrides["rounds"] = args.rounds
        if args.requests:
            overrides["requests"] = args.requests
        chosen.append(Workload(**{**asdict(w), **overrides}))
    logs = OUT_DIR / "throughput-logs"
    for w in chosen:
        (logs / w.model).mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    results = [measure_model(w, logs, args.step_scheduler) for w in chosen]
    print(
        table(
            [
                "model", "side", "requests", "prompt/out tok", "best s",
                "out tok/s (best)", "spread tok/s", "out tokens", "out tok/CPU-s",
            ],
            _rows(results),
        )
    )  # fmt: skip
    for res in results:
        sweep = ", ".join(f"c={c}: {v:,.0f}" for c, v in res["direct_sweep_tokens_per_s"].items())
        print(
            f"{res['model']} direct sweep (tok/s, {res['workload']['sweep_requests']} req): {sweep}"
        )
        print(f"{res['model']} ratio Backfill / best peer: {res['ratio_best']:.3f} "
              f"(goal >= {res['workload']['goal']})")  # fmt: skip
        if not res["token_counts_match"]:
            print(f"{res['model']}: WARNING output token counts differ between runs")
    plot_path = PLOT if not args.quick else OUT_DIR / "throughput-quick.png"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    plot(results, plot_path)
    print(f"plot: {plot_path}")
    by_model = {r["model"]: r for r in results}
    headline = by_model.get("smollm2") or results[0]
    details = {
        "command": "python -m bench.throughput"
        + (" --quick" if args.quick else "")
        + (" --step-scheduler" if args.step_scheduler else ""),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": started,
        "plot": str(plot_path),
        "models": by_model,
    }
    if args.step_scheduler:
        finish(
            NAME,
            f"{headline['model']}_step_vs_stock",
            headline["step_scheduler"]["ratio_best"],
            ">=",
            STEP_GOAL,
            details,
        )
        return
    finish(
        NAME,
        f"{headline['model']}_ratio",
        headline["ratio_best"],
        ">=",
        headline["workload"]["goal"],
        details,
    )


if __name__ == "__main__":
    main()
