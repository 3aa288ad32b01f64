"""The reduce tree over a document's chunk summaries: every node read once, depth
logarithmic, steps created once whatever order the driver sees them finish in."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.summarize.reduce_plan import (
    ReduceInfeasible,
    fan_in,
    plan_reduce,
    ready_steps,
)


@given(
    chunks=st.integers(min_value=1, max_value=3000), width=st.integers(min_value=2, max_value=40)
)
def test_every_node_but_the_root_is_read_by_exactly_one_step(chunks, width):
    plan = plan_reduce(chunks, width)
    read = [child for step in plan.steps for child in step.children]
    assert sorted(read) == sorted(set(range(plan.nodes)) - {plan.root})
    assert all(2 <= len(step.children) <= width for step in plan.steps)
    assert plan.nodes == chunks + len(plan.steps)
    # Each step reads nodes made before it, whose chunks follow one another in the document.
    covered = {node: [node] for node in range(chunks)}
    for step in plan.steps:
        assert all(child < step.node for child in step.children)
        covered[step.node] = [c for child in step.children for c in covered[child]]
        first = covered[step.node][0]
        assert covered[step.node] == list(range(first, first + len(covered[step.node])))
    assert covered[plan.root] == list(range(chunks))


@given(
    chunks=st.integers(min_value=1, max_value=3000), width=st.integers(min_value=2, max_value=40)
)
def test_the_tree_is_logarithmically_deep(chunks, width):
    plan = plan_reduce(chunks, width)
    assert plan.depth == (math.ceil(math.log(chunks, width) - 1e-9) if chunks > 1 else 0)
    levels = {step.node: step.level for step in plan.steps}
    for step in plan.steps:
        assert step.level == 1 + max(levels.get(c, 0) for c in step.children)


def test_a_document_of_one_chunk_has_no_reduce():
    plan = plan_reduce(1, 8)
    assert plan.steps == ()
    assert plan.root == 0
    assert plan.depth == 0


def test_chunks_that_fit_one_step_are_reduced_once():
    plan = plan_reduce(5, 8)
    assert [s.children for s in plan.steps] == [(0, 1, 2, 3, 4)]
    assert plan.depth == 1


def test_groups_are_even_and_a_lone_node_is_carried_up():
    plan = plan_reduce(3, 2)
    assert [(s.node, s.children, s.level) for s in plan.steps] == [(3, (0, 1), 1), (4, (3, 2), 2)]
    plan = plan_reduce(9, 4)  # 3 + 3 + 3, not 4 + 4 + 1
    assert [len(s.children) for s in plan.steps] == [3, 3, 3, 3]


@given(
    chunks=st.integers(min_value=1, max_value=300),
    width=st.integers(min_value=2, max_value=9),
    seed=st.integers(),
)
def test_a_driver_run_in_any_order_creates_each_step_once(chunks, width, seed):
    plan = plan_reduce(chunks, width)
    rng = random.Random(seed)
    finished: set[int] = set()
    created: list[int] = []
    running = list(range(chunks))
    while running:
        done = running.pop(rng.randrange(len(running)))
        finished.add(done)
        # The driver may run twice over the same state (killed after creating, before noting).
        for _ in range(rng.choice((1, 2))):
            for step in ready_steps(plan, finished, created):
                created.append(step.node)
                running.append(step.node)
    assert sorted(created) == [s.node for s in plan.steps]
    assert plan.root in finished


def test_fan_in_is_what_one_prompt_holds():
    assert fan_in(1000, 100, separator_tokens=0) == 10
    assert fan_in(1000, 96) == 10
    with pytest.raises(ReduceInfeasible, match="shorter summaries"):
        fan_in(300, 200)
    with pytest.raises(ReduceInfeasible):
        plan_reduce(4, 1)
    with pytest.raises(ValueError, match="at least one chunk"):
        plan_reduce(0, 4)
