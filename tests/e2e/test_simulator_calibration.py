"""The simulator's calibration code against a real vLLM engine: a short workload, sized from
the engine's measured speed, is measured, fitted and replayed in the simulator.

This checks the code (the probe's measurements, the fit, the closed-loop replay), not the
fit's accuracy: how well a fit reproduces a held-back workload depends on the machine and its
load, so that is a benchmark (``python -m bench.calibrate_simulator``, goal within 15%).
"""

from __future__ import annotations

import asyncio
import math
import os
from typing import Protocol

import pytest

from bench.simulator.calibrate import SHORT, fit, measure, sized_to
from devkit.enginespeed import EngineSpeed

pytestmark = pytest.mark.e2e

ENGINE_BUDGET_S = 60.0
# A step model off by half on average over the very steps it was fitted to does not describe
# the engine (fits here: 2-30% at load averages of 6-13 on 2 cores, one round 61%).
MAX_FIT_ERROR = 0.5


class EngineUnderTest(Protocol):
    """What the ``engine`` fixture (tests/e2e/conftest.py) tells about the server."""

    @property
    def url(self) -> str: ...
    @property
    def model(self) -> str: ...


def test_a_cost_model_is_fitted_to_every_term_and_replays_a_held_back_workload(
    engine: EngineUnderTest, engine_speed: EngineSpeed
) -> None:
    workload = sized_to(SHORT, engine_speed, ENGINE_BUDGET_S)
    # A burst of foreign load during one round can put any one observation far off (and on
    # the tiny model, whose steps cost nearly the same whatever they hold, noise has once
    # pushed both the step overhead and the per-decode term negative, leaving no valid
    # model); further rounds tell such noise (gone) from a fit that does not work (still off).
    failures: list[str] = []
    for round_ in (1, 2, 3):
        observations, held = asyncio.run(measure(engine.url, engine.model, workload))
        try:
            model, rms = fit(observations, engine.model)
        except ValueError as exc:
            failures.append(f"round {round_}: {exc}; observations {observations}")
            print(failures[-1])
            continue
        print(
            f"round {round_}: {len(observations)} observations, fit RMS {rms:.1%}, load "
            f"average {os.getloadavg()[0]:.1f}"
        )
        prefills = [o for o in observations if o.with_request_overhead]
        longest, shortest = max(prefills, key=lambda o: o.work.prefill_tokens), prefills[0]
        # At a load of ~12 the tiny model's 32- and 768-token prefills measured alike (noise
        # over the cost of 736 tokens) and the fit gave prefill no cost: such a round is
        # noise too, as one over the error bound is.
        sees_prefill = model.step_seconds(longest.work) > model.step_seconds(shortest.work)
        # A decode case whose requests never decoded together in its tries is left out by
        # the probe (the API server passed the last one in after the first had finished:
        # CI's run of 2026-12-07 on the tiny model, 3 of 4 cases): noise too, for a round.
        decodes = [o for o in observations if not o.with_request_overhead]
        all_decoded = len(decodes) == len(workload.decode_cases)
        if rms <= MAX_FIT_ERROR and sees_prefill and all_decoded:
            break
        failures.append(
            f"round {round_}: fit RMS {rms:.1%}, prefill costed {sees_prefill}, "
            f"{len(decodes)} of {len(workload.decode_cases)} decode cases: {model}; "
            f"{observations}"
        )
    else:
        pytest.fail("no round gave a fit:\n" + "\n".join(failures))
    assert [o.work.prefill_tokens for o in prefills] == list(workload.prefill_lengths)
    assert len(decodes) == len(workload.decode_cases), "a decode case yielded no decode steps"
    assert model.step_seconds(longest.work) > model.step_seconds(shortest.work), model

    check = held.against(model)
    print(
        f"held back ({len(held.shapes)} requests, {held.concurrency} at a time): output tok/s "
        f"real {check.real_tokens_per_s:.1f} sim {check.sim_tokens_per_s:.1f}; TTFT p50 real "
        f"{check.real_ttft_p50_s:.3f} s sim {check.sim_ttft_p50_s:.3f} s (not asserted: "
        "accuracy is the benchmark's)"
    )
    assert held.num_blocks > 0
    for value in (check.sim_tokens_per_s, check.sim_ttft_p50_s, check.real_tokens_per_s):
        assert math.isfinite(value), check
        assert value > 0, check
