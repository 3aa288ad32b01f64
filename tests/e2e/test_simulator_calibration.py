"""The simulator's cost model against a real vLLM engine (SmolLM2-135M on this machine's CPU).

Fits the cost model to prefill and decode measurements taken now, then replays a held-back
closed-loop workload on the engine and in the simulator: output tokens/s and median time to
first token must agree within 15% (in one of two rounds: see the test). The stored fit
(``vllm-cpu-smollm2.json``) is held to the same bound when the machine is otherwise quiet;
under foreign load its absolute speeds no longer describe this engine, so it is only reported.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from backfill.simulate import costmodel
from bench.calibrate_simulator import fit, measure
from worker import devengine

TOLERANCE = 0.15


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_fitted_cost_model_reproduces_a_held_back_workload() -> None:
    load_before = os.getloadavg()[0]
    try:
        server = devengine.start_model("smollm2", kv_cache_gib=1)
    except devengine.DevEngineError as exc:
        pytest.fail(f"could not start the SmolLM2 engine: {exc}", pytrace=False)
    try:
        # A burst of foreign load during one round changes the engine's speed between the
        # fit and the held-back run, which no cost model can follow; a second round tells
        # such noise (gone) from model error (still there).
        for round_ in (1, 2):
            observations, held = asyncio.run(measure(server.url, "smollm2", repeats=2))
            model, rms = fit(observations, "smollm2")
            check = held.against(model)
            print(f"round {round_}: fit RMS {rms:.1%}; held back: tok/s real "
                  f"{check.real_tokens_per_s:.1f} sim {check.sim_tokens_per_s:.1f}; TTFT p50 "
                  f"real {check.real_ttft_p50_s:.2f} sim {check.sim_ttft_p50_s:.2f}; load "
                  f"average {os.getloadavg()[0]:.1f}")
            if check.throughput_error <= TOLERANCE and check.ttft_error <= TOLERANCE:
                break
    finally:
        server.stop()
    assert check.throughput_error <= TOLERANCE, check
    assert check.ttft_error <= TOLERANCE, check

    stored = held.against(costmodel.load("vllm-cpu-smollm2"))
    print(f"stored fit: tok/s sim {stored.sim_tokens_per_s:.1f} ({stored.throughput_error:.1%}), "
          f"TTFT p50 sim {stored.sim_ttft_p50_s:.2f} ({stored.ttft_error:.1%}); "
          f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    quiet = max(load_before, os.getloadavg()[0]) < (os.cpu_count() or 1)
    if quiet:
        assert stored.throughput_error <= TOLERANCE, stored
        assert stored.ttft_error <= TOLERANCE, stored
