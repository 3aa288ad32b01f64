"""Every policy on one scenario, the baselines that give the results meaning, and knob
sweeps that compare policies at equal interactive SLO attainment.

*Slack capacity* is what an engine could give batch if batch had it whenever interactive
did not need it: batch alone's output rate x the share of time interactive alone leaves the
engine idle. A policy *harvests* its batch output rate over that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from backfill_analysis.simulate.metrics import PolicyResult
from backfill_analysis.simulate.policies import POLICY_NAMES, PolicyKnobs
from backfill_analysis.simulate.run import RunSpec, simulate
from backfill_analysis.simulate.scenario import Scenario
from backfill_analysis.simulate.trace import TraceRequest, load_trace
from backfill_analysis.simulate.workload import BatchItem, batch_items

SWEEPS: dict[str, tuple[str, tuple[float, ...]]] = {
    # policy: (knob, values from most to least protective)
    "fifo": ("batch_concurrency", (4, 8, 16, 32, 64, 128)),
    "priority": ("batch_concurrency", (4, 8, 16, 32, 64, 128, 256)),
    "static": ("reserve_fraction", (0.97, 0.95, 0.9, 0.8, 0.6, 0.25)),
    "backfill": ("busy_batch_seqs", (4, 16, 32, 64, 128, 256)),
    "backfill-overcommit": ("busy_batch_seqs", (4, 16, 32, 64, 128, 256)),
    # The TTFT target the work budget protects: a tighter one shrinks, holds and preempts
    # batch sooner.
    "backfill-budget": ("budget_ttft_target_s", (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)),
    # The step time batch prefill may add to a step (GPU-scale values): a smaller cap keeps
    # the step an arriving interactive request waits for shorter, and batch prefill slower.
    "backfill-step": ("chunk_target_s", (0.005, 0.0075, 0.01, 0.015, 0.02, 0.05, 0.1)),
}


@dataclass(frozen=True)
class Baselines:
    interactive_alone: PolicyResult
    batch_alone: PolicyResult

    @property
    def slack_tokens_per_s(self) -> float:
        idle_share = 1.0 - self.interactive_alone.busy_s / self.interactive_alone.duration_s
        return self.batch_alone.batch_tokens_per_s * max(0.0, idle_share)

    def overall_gain(self, result: PolicyResult) -> float:
        """All tokens computed (prompt and output, both classes) over interactive alone's:
        the "overall throughput vs online-only" ratio HyGen and ConServe report."""
        alone = self.interactive_alone.interactive_tokens_per_s
        total = (
            result.interactive_tokens_per_s
            + result.batch_tokens_per_s
            + result.batch_prompt_tokens_per_s
        )
        return total / alone if alone > 0 else 0.0

    def harvest(self, result: PolicyResult) -> float:
        slack = self.slack_tokens_per_s
        return result.batch_tokens_per_s / slack if slack > 0 else 0.0


@dataclass
class Comparison:
    scenario: Scenario
    results: list[PolicyResult]
    baselines: Baselines
    interactive: int
    batch_items: int


def workload(
    scenario: Scenario, trace_path: Path | str, seed: int
) -> tuple[list[TraceRequest], list[BatchItem]]:
    trace = load_trace(
        trace_path, dataclasses.replace(scenario.trace, duration_s=scenario.duration_s)
    )
    return trace, batch_items(scenario.batch, seed)


def _spec(
    scenario: Scenario,
    trace: Sequence[TraceRequest],
    items: Sequence[BatchItem],
    knobs: PolicyKnobs | None = None,
) -> RunSpec:
    return RunSpec(
        scenario.engine,
        trace,
        items,
        scenario.duration_s,
        scenario.ttft_slo_s,
        knobs or scenario.knobs,
        scenario.sample_every_s,
    )


def baselines(
    scenario: Scenario, trace: Sequence[TraceRequest], items: Sequence[BatchItem]
) -> Baselines:
    alone = simulate(_spec(scenario, trace, []), "priority")
    flat_out = dataclasses.replace(scenario.knobs, batch_concurrency=scenario.engine.max_num_seqs)
    batch = simulate(_spec(scenario, [], items, flat_out), "priority")
    return Baselines(alone, batch)


def compare(
    scenario: Scenario,
    trace_path: Path | str,
    *,
    seed: int = 0,
    policies: Sequence[str] = POLICY_NAMES,
) -> Comparison:
    trace, items = workload(scenario, trace_path, seed)
    results = [simulate(_spec(scenario, trace, items), p) for p in policies]
    return Comparison(scenario, results, baselines(scenario, trace, items), len(trace), len(items))


def sweep(
    scenario: Scenario,
    trace_path: Path | str,
    *,
    seed: int = 0,
    policies: Sequence[str] = POLICY_NAMES,
    values: Mapping[str, Sequence[float]] | None = None,
) -> dict[str, list[tuple[float, PolicyResult]]]:
    """Each policy across its knob (:data:`SWEEPS`), at ``values[policy]`` where given."""
    trace, items = workload(scenario, trace_path, seed)
    curves: dict[str, list[tuple[float, PolicyResult]]] = {}
    for name in policies:
        knob, default = SWEEPS[name]
        points = []
        for value in (values or {}).get(name, default):
            knobs = _with_knob(scenario.knobs, knob, value)
            points.append((value, simulate(_spec(scenario, trace, items, knobs), name)))
        curves[name] = points
    return curves


def _with_knob(knobs: PolicyKnobs, knob: str, value: float) -> PolicyKnobs:
    if knob == "reserve_fraction":
        return dataclasses.replace(knobs, reserve_fraction=value)
    if knob == "batch_concurrency":
        return dataclasses.replace(knobs, batch_concurrency=int(value))
    if knob == "busy_batch_seqs":
        return dataclasses.replace(knobs, busy_batch_seqs=int(value))
    if knob == "budget_ttft_target_s":
        budget = dataclasses.replace(knobs.work_budget, ttft_target_s=value)
        return dataclasses.replace(knobs, work_budget=budget)
    step = knobs.step_schedule
    if knob == "chunk_target_s":
        return dataclasses.replace(
            knobs, step_schedule=dataclasses.replace(step, chunk_target_s=value)
        )
    if knob == "ride_along_share":
        return dataclasses.replace(
            knobs, step_schedule=dataclasses.replace(step, ride_along_share=value)
        )
    if knob == "starvation_s":
        return dataclasses.replace(
            knobs, step_schedule=dataclasses.replace(step, starvation_s=value)
        )
    if knob == "starvation_steps":
        return dataclasses.replace(
            knobs, step_schedule=dataclasses.replace(step, starvation_steps=int(value))
        )
    raise ValueError(f"no knob {knob!r}")


def best_at_slo(
    points: Sequence[tuple[float, PolicyResult]], target: float, ttft_target_s: float | None = None
) -> tuple[float, PolicyResult] | None:
    """The knob setting with the most batch throughput among those whose interactive SLO
    attainment (at ``ttft_target_s``, default the run's own target) is at least ``target``."""
    meeting = [
        p
        for p in points
        if (p[1].slo_attainment if ttft_target_s is None else p[1].attainment(ttft_target_s))
        >= target
    ]
    return max(meeting, key=lambda p: p[1].batch_tokens_per_s) if meeting else None
