"""Fit the simulator's cost model to a real vLLM engine on this machine, and check it.

    python -m bench.calibrate_simulator [--model smollm2] [--engine-url URL] [--write]

Starts the engine (``worker.devengine``) unless given one; measures prefill steps (one prompt
at a time) and decode steps (many sequences decoding together, short and long contexts); fits
``step = a + b*prefill + d*prefill_attention + c*decodes + e*context`` plus a per-request
overhead (:func:`backfill.simulate.costmodel.fit_cost_model`); then replays a held-back
closed-loop workload against the engine and the simulator and compares output tokens/s and
median time to first token. ``--write`` stores the fit in
``backfill/simulate/calibration/vllm-cpu-<model>.json`` with its measurements.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from backfill.simulate.closedloop import closed_loop
from backfill.simulate.costmodel import CALIBRATION_DIR, CostModel, Observation, fit_cost_model
from backfill.simulate.engine import EngineConfig
from bench.engine_probe import Probe, decode_observations, prefill_observations, warm_up

PREFILL_LENGTHS = (32, 256, 512, 1024, 1536, 1984)
DECODE_CASES = ((1, 16, 64), (8, 16, 64), (32, 16, 64), (64, 16, 64), (8, 1024, 64),
                (16, 512, 64))
HELD_BACK_SEED = 20261129
HELD_BACK_CONCURRENCY = 16
# vLLM's CPU defaults; the dev engine's 1 GiB of KV for SmolLM2 is 364 blocks of 128.
CPU_BLOCKS, CPU_BLOCK_SIZE, CPU_BATCHED_TOKENS, CPU_MAX_SEQS = 364, 128, 2048, 128


def held_back_shapes(n: int = 48) -> list[tuple[int, int]]:
    """A mix not used for fitting: prompts 200-800 tokens, outputs 16-128. Outputs vary so
    that requests do not finish (and their successors arrive) in lockstep waves, which would
    make the median TTFT hinge on the order within a wave rather than on step times."""
    rng = random.Random(HELD_BACK_SEED)
    return [(rng.randint(200, 800), rng.randint(16, 128)) for _ in range(n)]


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


@dataclass(frozen=True)
class HeldBack:
    shapes: list[tuple[int, int]]
    concurrency: int
    real_tokens_per_s: float
    real_ttft_p50_s: float

    def against(self, model: CostModel) -> Comparison:
        config = EngineConfig(CPU_BLOCKS, CPU_BLOCK_SIZE, model, CPU_BATCHED_TOKENS, CPU_MAX_SEQS)
        sim = closed_loop(config, self.shapes, self.concurrency)
        return Comparison(self.real_tokens_per_s, sim.output_tokens_per_s,
                          self.real_ttft_p50_s, sim.ttft_p50_s)


async def measure(url: str, model: str, *, repeats: int = 3
                  ) -> tuple[list[Observation], HeldBack]:
    """The fitting observations (medians over ``repeats``) and the held-back workload."""
    probe = Probe(url, model)
    try:
        await warm_up(probe)
        observations: list[Observation] = []
        runs = [await prefill_observations(probe, PREFILL_LENGTHS, 1) for _ in range(repeats)]
        for same in zip(*runs, strict=True):
            observations.append(min(same, key=lambda o: abs(
                o.seconds - statistics.median(x.seconds for x in same))))
        observations += await decode_observations(probe, DECODE_CASES)
        shapes = held_back_shapes()
        timings, span = await probe.closed_loop(shapes, HELD_BACK_CONCURRENCY)
        held = HeldBack(
            shapes, HELD_BACK_CONCURRENCY,
            real_tokens_per_s=sum(t.output_tokens for t in timings) / span,
            real_ttft_p50_s=statistics.median(t.ttft for t in timings),
        )
        return observations, held
    finally:
        await probe.close()


def fit(observations: list[Observation], model: str) -> tuple[CostModel, float]:
    return fit_cost_model(
        observations, name=f"vllm-cpu-{model}",
        source=f"fitted by python -m bench.calibrate_simulator --model {model} to vLLM 0.32 "
        f"(vllm-cpu) on {os.cpu_count()} CPU cores, --enforce-eager, 2,048 batched tokens",
    )


def record(model: CostModel, rms: float, observations: list[Observation], held: HeldBack,
           check: Comparison) -> dict[str, Any]:
    return {
        "model": model.to_json(),
        "fit_rms_relative_error": rms,
        "measured": datetime.now(UTC).isoformat(timespec="seconds"),
        "load_average_1m": os.getloadavg()[0],
        "how": __doc__,
        "observations": [asdict(o) for o in observations],
        "held_back": {**asdict(check), "requests": len(held.shapes),
                      "concurrency": held.concurrency},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.calibrate_simulator")
    p.add_argument("--model", default="smollm2", choices=("smollm2", "tiny"))
    p.add_argument("--engine-url", help="a running server of --model (else one is started)")
    p.add_argument("--write", action="store_true", help="store the fit in the repository")
    args = p.parse_args(argv)
    server = None
    url = args.engine_url
    if url is None:
        from worker import devengine  # noqa: PLC0415 - only when we start the engine

        server = devengine.start_model(args.model, kv_cache_gib=1)
        url = server.url
    try:
        print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
        observations, held = asyncio.run(measure(url, args.model))
    finally:
        if server is not None:
            server.stop()
    model, rms = fit(observations, args.model)
    check = held.against(model)
    print(json.dumps(model.to_json(), indent=2))
    print(f"fit RMS relative error {rms:.1%}")
    print(f"held back: output tok/s real {check.real_tokens_per_s:.1f} sim "
          f"{check.sim_tokens_per_s:.1f} ({check.throughput_error:.1%}); TTFT p50 real "
          f"{check.real_ttft_p50_s:.2f} s sim {check.sim_ttft_p50_s:.2f} s "
          f"({check.ttft_error:.1%})")
    if args.write:
        path = CALIBRATION_DIR / f"vllm-cpu-{args.model}.json"
        path.write_text(json.dumps(record(model, rms, observations, held, check), indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if max(check.throughput_error, check.ttft_error) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
