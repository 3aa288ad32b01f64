"""``bench.gpu_steps``: the cost model stored from steps timed on a real H200 is their fit, the
engine scheduler's own step model reads those steps alike, and the curve's verdict picks the
setting that keeps the most batch within the TTFT goal."""

from __future__ import annotations

import json
import math
import random

import pytest

from backfill_analysis.simulate import costmodel
from backfill_analysis.simulate.scenario import h100_llama8b, scenario
from backfill_vllm.policy import idle_ready
from backfill_vllm.stepmodel import StepTimeModel
from bench.common import table
from bench.simulator.gpu_fit import fit, step_work
from bench.simulator.gpu_steps import (
    STORED,
    Point,
    at_kept,
    best,
    idle_ready_scenario,
    pareto,
    step_rows,
)


def test_the_stored_h200_model_is_the_fit_of_its_own_measurements() -> None:
    stored = json.loads(STORED.read_text())
    model, error = fit(stored["measured"])
    assert model.to_json() == stored["model"]
    assert error == pytest.approx(stored["fit_rms_relative_error"])
    assert error < 0.1
    steps = [s for s in stored["measured"]["steps"] if s.get("graph_s") is not None]
    assert len(steps) >= 20
    for s in steps:  # every measured step within 20% of the fit (the worst: 15%, a short prompt)
        predicted = model.step_seconds(step_work(s))
        assert abs(predicted / s["graph_s"] - 1) < 0.2, (s, predicted)


def test_the_h200_scenario_runs_on_the_measured_steps_and_an_h200_pool() -> None:
    h200, h100 = scenario("h200-llama-3.1-8b"), h100_llama8b()
    assert h200.engine.cost == costmodel.load("h200-llama-3.1-8b-torch")
    assert h200.engine.num_blocks > 1.5 * h100.engine.num_blocks  # 141 GB against 80 GiB
    assert (h200.trace, h200.batch, h200.knobs) == (h100.trace, h100.batch, h100.knobs)


def _point(policy: str, value: str, p50: float, p99: float, kept: float) -> Point:
    return Point(policy, "knob", value, p50, p99, kept, kept, 1.0)


def test_the_verdict_takes_the_most_batch_kept_with_both_ttft_ratios_within_the_goal() -> None:
    points = [
        _point("backfill-step", "a", 1.05, 1.0, 0.3),
        _point("backfill-step", "b", 1.09, 1.1, 0.45),
        _point("backfill-step", "c", 1.2, 1.0, 0.8),  # p50 over
        _point("backfill-step", "d", 1.0, 1.3, 0.9),  # p99 over
        _point("priority", "e", 1.05, 1.05, 0.99),  # another policy
    ]
    chosen = best(points, "backfill-step", 1.1)
    assert chosen is not None
    assert chosen.value == "b"
    # At the headline goal (1.05x) only "a" is within it.
    headline = best(points, "backfill-step")
    assert headline is not None
    assert headline.value == "a"
    assert best(points[2:4], "backfill-step", 1.1) is None


def test_the_engine_schedulers_own_step_model_reads_the_h200_steps_as_the_offline_fit() -> None:
    """``backfill_vllm``'s in-engine step model (two regressors, no attention or context terms),
    fed the steps timed on the H200 in a shuffled stream: it separates decodes from prompt
    tokens, finds the step's fixed cost, and prices a 4 ms chunk of batch prefill about as the
    offline fit does (the cap it would set on such a GPU)."""
    stored = json.loads(STORED.read_text())
    offline = costmodel.CostModel.from_json(stored["model"])
    steps = [s for s in stored["measured"]["steps"] if s.get("graph_s") is not None]
    model = StepTimeModel()
    rng = random.Random(0)
    for _ in range(4):
        rng.shuffle(steps)
        for s in steps:
            model.observe(s["prefill"] + s["decodes"], s["graph_s"], s["decodes"])
    fit = model.fit()
    assert fit is not None
    assert fit.per_decode_s is not None  # decodes told apart from prompt tokens
    assert fit.base_s == pytest.approx(offline.step_overhead_s, rel=0.2)
    chunk = 0.004 / offline.per_prefill_token_s  # ~178 tokens
    assert 0.6 * chunk <= fit.tokens_within(0.004) <= 1.4 * chunk, (fit, chunk)


def test_the_step_table_shows_a_step_that_failed_on_the_gpu_beside_the_timed_ones() -> None:
    stored = json.loads(STORED.read_text())
    measured = stored["measured"]
    failed = {"prefill": 8192, "start": 0, "decodes": 256, "context": 2048, "error": "OOM"}
    rows = step_rows({**measured, "steps": [*measured["steps"], failed]}, fit(measured)[0])
    assert len({len(r) for r in rows}) == 1
    shown = table([str(i) for i in range(len(rows[0]))], rows)
    assert shown.splitlines()[-1].split()[4] == "failed"


def test_the_pareto_front_keeps_the_points_nothing_beats_on_kept_p50_and_p99() -> None:
    points = [
        _point("backfill-step", "a", 1.04, 1.01, 0.60),
        _point("backfill-step", "b", 1.05, 1.02, 0.55),  # a beats it on all three
        _point("backfill-step+idle", "c", 1.02, 1.00, 0.40),  # less kept, better TTFT
        _point("backfill-step", "d", 1.30, 1.10, 0.80),  # the most kept
        _point("backfill-step", "e", 1.04, 1.01, 0.60),  # equal to a: both stay
    ]
    assert [p.value for p in pareto(points)] == ["d", "a", "e", "c"]


def test_the_peer_is_read_at_the_same_batch_kept_along_its_curve() -> None:
    curve = [_point("priority", "8", 1.2, 1.0, 0.2), _point("priority", "32", 1.6, 1.2, 0.6)]
    assert at_kept(curve, 0.5) == pytest.approx((1.5, 1.15))
    assert at_kept(curve, 0.2) == pytest.approx((1.2, 1.0))
    p50, p99 = at_kept(curve, 0.9)  # past its end: not made up
    assert math.isnan(p50)
    assert math.isnan(p99)


def test_the_idle_ready_sweep_runs_the_engine_classes_own_rule() -> None:
    sc = idle_ready_scenario(scenario("h200-llama-3.1-8b"), 2.0, 0.02, 3.0)
    step = sc.knobs.step_schedule
    assert step.idle_rule is idle_ready
    assert (step.idle_ready_s, step.lift_cap_after_s, step.lifted_step_target_s) == (2.0, 2.0, 0.02)
    assert step.starvation_s == 3.0
