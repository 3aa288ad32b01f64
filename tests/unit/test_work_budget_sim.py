"""The simulator's "Backfill + work budget" policy runs the worker's controller
(``backfill.work_budget``): it protects interactive TTFT better than engine priority alone,
keeps batch running, preempts only when a target is tight, and a tighter target trades batch
throughput for TTFT."""

from __future__ import annotations

import dataclasses

from backfill.work_budget import WorkBudgetPolicy
from backfill_analysis.simulate.engine import Engine
from backfill_analysis.simulate.policies import BackfillWorkBudget, Frontend
from backfill_analysis.simulate.run import RunSpec, simulate
from tests.unit.test_simulator import _spec


def _with_target(target_s: float) -> RunSpec:
    spec = _spec()
    budget = WorkBudgetPolicy(ttft_target_s=target_s, ceiling_seqs=32, floor_seqs=1)
    return dataclasses.replace(spec, knobs=dataclasses.replace(spec.knobs, work_budget=budget))


def test_budget_policy_protects_interactive_better_than_priority_alone() -> None:
    spec = _with_target(1.0)
    priority = simulate(_spec(), "priority")
    budget = simulate(spec, "backfill-budget")
    assert budget.ttft_p99_s < priority.ttft_p99_s
    assert budget.ttft_p50_s <= priority.ttft_p50_s
    assert budget.batch_tokens_per_s > 0.3 * priority.batch_tokens_per_s


def test_a_tighter_target_trades_batch_throughput_for_ttft() -> None:
    loose = simulate(_with_target(8.0), "backfill-budget")
    tight = simulate(_with_target(0.05), "backfill-budget")
    assert tight.ttft_p99_s <= loose.ttft_p99_s
    assert tight.batch_tokens_per_s <= loose.batch_tokens_per_s
    assert tight.preemptions > loose.preemptions


def test_batch_never_exceeds_the_budget_it_was_admitted_under() -> None:
    seen: list[tuple[int, int]] = []

    def observe(frontend: Frontend, engine: Engine) -> None:
        assert isinstance(frontend, BackfillWorkBudget)
        seen.append((frontend.batch_in_flight, frontend.budget.max_seqs))

    simulate(_with_target(0.05), "backfill-budget", observe)
    # A shrink does not stop running work at once (only preemption does), but batch never
    # exceeds the ceiling and does run below it while interactive is active.
    assert max(n for n, _ in seen) <= 32
    assert min(b for _, b in seen) < 32, "the budget never shrank"
