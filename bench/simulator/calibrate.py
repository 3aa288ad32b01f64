"""Fit the simulator's cost model to a real vLLM engine on this machine, and check it.

    python -m bench.calibrate_simulator [--quick] [--model smollm2] [--engine-url URL] [--write]

Starts the engine (``devkit.devengine``) unless given one; measures its speed
(:mod:`devkit.enginespeed`); measures prefill steps (one prompt at a time) and decode steps
(many sequences decoding together, short and long contexts); fits
``step = a + b*prefill + d*prefill_attention + c*decodes + e*context`` plus a per-request
overhead (:func:`backfill_analysis.simulate.costmodel.fit_cost_model`); then replays a held-back
closed-loop workload against the engine and the simulator and compares output tokens/s and
median time to first token (goal: within 15%), also for the stored fit. ``--quick`` runs a
short workload sized from the measured speed to about a minute of engine time. ``--write``
(full runs only) stores the fit in ``backfill/simulate/calibration/vllm-cpu-<model>.json``
with its measurements.

Ends with ``calibrate_simulator: held_back_error=<worse of the two errors> (goal <= 0.15)``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from typing import Any

import httpx

from backfill.engine_metrics import parse_cache_config
from backfill_analysis.simulate import costmodel
from backfill_analysis.simulate.closedloop import closed_loop
from backfill_analysis.simulate.costmodel import (
    CALIBRATION_DIR,
    CostModel,
    Observation,
    fit_cost_model,
)
from backfill_analysis.simulate.engine import EngineConfig
from bench.common import finish, parser, table
from bench.simulator.engine_probe import Probe, decode_observations, prefill_observations, warm_up
from devkit.enginespeed import EngineSpeed, measure_speed

NAME = "calibrate_simulator"
GOAL = 0.15
HELD_BACK_SEED = 20261129
# vLLM's CPU defaults for the scheduler; the pool is read from the engine (1 GiB of KV is 364
# blocks of 128 for SmolLM2 in bfloat16, half that in float32).
CPU_BATCHED_TOKENS, CPU_MAX_SEQS = 2048, 128
QUICK_ENGINE_S = 60.0


def held_back_shapes(
    n: int = 48, prompts: tuple[int, int] = (200, 800), outputs: tuple[int, int] = (16, 128)
) -> tuple[tuple[int, int], ...]:
    """A mix not used for fitting (prompt, output). Outputs vary so that requests do not
    finish (and their successors arrive) in lockstep waves, which would make the median TTFT
    hinge on the order within a wave rather than on step times."""
    rng = random.Random(HELD_BACK_SEED)
    return tuple((rng.randint(*prompts), rng.randint(*outputs)) for _ in range(n))


@dataclass(frozen=True)
class Workload:
    """What is measured: prompts alone (``repeats`` times each), decode cases
    ``(sequences, prompt, output)``, and the held-back closed loop."""

    prefill_lengths: tuple[int, ...]
    repeats: int
    decode_cases: tuple[tuple[int, int, int], ...]
    held_back: tuple[tuple[int, int], ...]
    concurrency: int

    def estimated_seconds(self, speed: EngineSpeed) -> float:
        """Engine time at ``speed``. Prompts are counted one after another (prefill is
        compute-bound: batching does not shorten it); sequences decoding together as one
        stream alone, which errs short on a bigger model (SmolLM2's step with 16 sequences
        takes ~4x one's)."""
        prefill = self.repeats * sum(speed.seconds_for(p, 1) for p in self.prefill_lengths)
        decode = sum(speed.seconds_for(n * p, o) for n, p, o in self.decode_cases)
        held = speed.seconds_for(
            sum(p for p, _ in self.held_back), sum(o for _, o in self.held_back) / self.concurrency
        )
        return prefill + decode + held

    def with_prompts_scaled(self, factor: float) -> Workload:
        def scaled(tokens: int) -> int:
            return max(16, round(tokens * factor))

        return replace(
            self,
            prefill_lengths=tuple(sorted({scaled(p) for p in self.prefill_lengths})),
            decode_cases=tuple((n, scaled(p), o) for n, p, o in self.decode_cases),
            held_back=tuple((scaled(p), o) for p, o in self.held_back),
        )


FULL = Workload(
    prefill_lengths=(32, 256, 512, 1024, 1536, 1984),
    repeats=3,
    decode_cases=(
        (1, 16, 64),
        (8, 16, 64),
        (32, 16, 64),
        (64, 16, 64),
        (8, 1024, 64),
        (16, 512, 64),
    ),
    held_back=held_back_shapes(),
    concurrency=16,
)
SHORT = Workload(
    prefill_lengths=(32, 128, 384, 768),
    repeats=3,
    decode_cases=((1, 16, 16), (8, 16, 16), (16, 16, 16), (4, 512, 16)),
    held_back=held_back_shapes(12, prompts=(64, 384), outputs=(8, 48)),
    concurrency=4,
)
"""Every term of the cost model, a few seconds of a tiny model's time: the suite's check."""


def sized_to(workload: Workload, speed: EngineSpeed, budget_s: float) -> Workload:
    """``workload`` with its prompts halved until its estimated engine time at ``speed``
    fits ``budget_s``, or until halving again would merge two prompt lengths (the fit needs
    several to tell the per-token term from the attention term)."""
    sized, factor = workload, 1.0
    while sized.estimated_seconds(speed) > budget_s:
        shorter = workload.with_prompts_scaled(factor / 2)
        if len(shorter.prefill_lengths) < len(workload.prefill_lengths):
            break
        sized, factor = shorter, factor / 2
    return sized


@dataclass(frozen=True)
class Comparison:
    real_tokens_per_s: float
    sim_tokens_per_s: float
    real_ttft_p50_s: float
    sim_ttft_p50_s: float

    @property
    def throughput_error(self) -> float:
        return abs(self.sim_tokens_per_s / self.real_tokens_per_s - 1)

    @property
    def ttft_error(self) -> float:
        return abs(self.sim_ttft_p50_s / self.real_ttft_p50_s - 1)

    @property
    def error(self) -> float:
        return max(self.throughput_error, self.ttft_error)


@dataclass(frozen=True)
class HeldBack:
    shapes: tuple[tuple[int, int], ...]
    concurrency: int
    num_blocks: int
    block_size: int
    """The engine's pool, as it reported it."""
    real_tokens_per_s: float
    real_ttft_p50_s: float

    def against(self, model: CostModel) -> Comparison:
        config = EngineConfig(
            self.num_blocks, self.block_size, model, CPU_BATCHED_TOKENS, CPU_MAX_SEQS
        )
        sim = closed_loop(config, self.shapes, self.concurrency)
        return Comparison(
            self.real_tokens_per_s, sim.output_tokens_per_s, self.real_ttft_p50_s, sim.ttft_p50_s
        )


async def measure(
    url: str, model: str, workload: Workload = FULL
) -> tuple[list[Observation], HeldBack]:
    """The fitting observations (medians over the repeats) and the held-back workload."""
    probe = Probe(url, model)
    try:
        pool = parse_cache_config((await probe.client.get(f"{probe.url}/metrics")).text)
        await warm_up(probe)
        observations: list[Observation] = []
        runs = [
            await prefill_observations(probe, workload.prefill_lengths, 1)
            for _ in range(workload.repeats)
        ]
        for same in zip(*runs, strict=True):
            observations.append(
                min(same, key=lambda o: abs(o.seconds - statistics.median(x.seconds for x in same)))
            )
        observations += await decode_observations(probe, workload.decode_cases)
        timings, span = await probe.closed_loop(workload.held_back, workload.concurrency)
        held = HeldBack(
            workload.held_back,
            workload.concurrency,
            pool.num_blocks,
            pool.block_size,
            real_tokens_per_s=sum(t.output_tokens for t in timings) / span,
            real_ttft_p50_s=statistics.median(t.ttft for t in timings),
        )
        return observations, held
    finally:
        await probe.close()


def fit(observations: list[Observation], model: str, dtype: str = "") -> tuple[CostModel, float]:
    served = f", {dtype}" if dtype else ""
    return fit_cost_model(
        observations,
        name=f"vllm-cpu-{model}",
        source=f"fitted by python -m bench.calibrate_simulator --model {model} to vLLM 0.32 "
        f"(vllm-cpu) on {os.cpu_count()} CPU cores{served}, --enforce-eager, 2,048 batched "
        "tokens",
    )


def record(
    model: CostModel,
    rms: float,
    observations: list[Observation],
    held: HeldBack,
    check: Comparison,
    dtype: str,
    speed: EngineSpeed,
) -> dict[str, Any]:
    return {
        "model": model.to_json(),
        "fit_rms_relative_error": rms,
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1m": os.getloadavg()[0],
        "dtype": dtype,
        "engine_speed": asdict(speed),
        "how": __doc__,
        "observations": [asdict(o) for o in observations],
        "held_back": {
            **asdict(check),
            "requests": len(held.shapes),
            "concurrency": held.concurrency,
            "num_blocks": held.num_blocks,
        },
    }


def _stored(model: str) -> CostModel | None:
    try:
        return costmodel.load(f"vllm-cpu-{model}")
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, "Fit the simulator's cost model to a real vLLM engine and check it.")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    p.add_argument("--engine-url", help="a running server of --model (else one is started)")
    p.add_argument("--write", action="store_true", help="store the fit (full runs only)")
    args = p.parse_args(argv)
    if args.write and args.quick:
        p.error("--write stores a calibration: run the full workload (no --quick)")
    server = None
    url, dtype = args.engine_url, "dtype unknown (engine given)"
    if url is None:
        from devkit import devengine  # noqa: PLC0415 - only when we start the engine

        server = devengine.start_model(args.model, kv_cache_gib=1)
        url, dtype = server.url, server.dtype
    load_before = os.getloadavg()[0]
    try:
        speed = measure_speed(url, args.model)
        workload = sized_to(SHORT, speed, QUICK_ENGINE_S) if args.quick else FULL
        print(
            f"engine: {args.model}, {dtype}, {speed}; this workload: ~"
            f"{workload.estimated_seconds(speed):.0f} s of engine time at most; load "
            f"average {load_before:.2f}",
            flush=True,
        )
        observations, held = asyncio.run(measure(url, args.model, workload))
    except httpx.HTTPError as exc:
        print(f"the engine at {url} failed: {exc!r}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()
    try:
        model, rms = fit(observations, args.model, "" if server is None else dtype)
    except ValueError as exc:
        print(f"no fit from {len(observations)} observations: {exc}")
        finish(
            NAME,
            "held_back_error",
            math.nan,
            "<=",
            GOAL,
            {
                "model": args.model,
                "quick": args.quick,
                "fit_error": str(exc),
                "observations": [asdict(o) for o in observations],
            },
        )
        return 1
    check = held.against(model)
    stored_model = _stored(args.model)
    stored = None if stored_model is None else held.against(stored_model)
    rows: list[tuple[Any, ...]] = [
        (
            "output tok/s",
            "this fit",
            check.real_tokens_per_s,
            check.sim_tokens_per_s,
            f"{check.throughput_error:.1%}",
        ),
        (
            "TTFT p50 (s)",
            "this fit",
            check.real_ttft_p50_s,
            check.sim_ttft_p50_s,
            f"{check.ttft_error:.1%}",
        ),
    ]
    if stored is not None:
        rows += [
            (
                "output tok/s",
                "stored fit",
                stored.real_tokens_per_s,
                stored.sim_tokens_per_s,
                f"{stored.throughput_error:.1%}",
            ),
            (
                "TTFT p50 (s)",
                "stored fit",
                stored.real_ttft_p50_s,
                stored.sim_ttft_p50_s,
                f"{stored.ttft_error:.1%}",
            ),
        ]
    print(json.dumps(model.to_json(), indent=2))
    print(
        f"fit RMS relative error {rms:.1%} over {len(observations)} observations; held back: "
        f"{len(held.shapes)} requests, {held.concurrency} at a time, pool {held.num_blocks} x "
        f"{held.block_size}; load average {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after"
    )
    print(table(("held back", "model", "real", "simulated", "error"), rows))
    if args.write:
        path = CALIBRATION_DIR / f"vllm-cpu-{args.model}.json"
        path.write_text(
            json.dumps(record(model, rms, observations, held, check, dtype, speed), indent=2) + "\n"
        )
        print(f"wrote {path}")
    ok = finish(
        NAME,
        "held_back_error",
        check.error,
        "<=",
        GOAL,
        {
            "model": args.model,
            "dtype": dtype,
            "quick": args.quick,
            "engine_speed": asdict(speed),
            "fit": model.to_json(),
            "fit_rms_relative_error": rms,
            "held_back": asdict(check),
            "stored_fit_held_back": None if stored is None else asdict(stored),
            "load_average_1m": [load_before, os.getloadavg()[0]],
        },
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
