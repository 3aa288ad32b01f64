"""How a split document's chunk summaries combine into one summary: the reduce tree.

The map steps summarise the chunks (nodes ``0 .. chunks-1``, in document order). A reduce
step summarises the summaries of at most ``fan_in`` consecutive nodes; where a document has
more chunks than one step can take, steps are combined by further steps, level by level, until
one node is left: the document's summary. Groups are as even as the fan-in allows; a node
left alone in its group is carried up as it is (a step over one summary would only
paraphrase it). So every node but the root is read by exactly one step, each step reads 2 to
``fan_in`` nodes, and the tree is ``ceil(log_fan_in(chunks))`` levels deep at most.

The plan is a value: :func:`plan_reduce` builds it from two numbers, and
:func:`ready_steps` says, from which nodes have finished and which steps exist, which steps to
create now. The server's driver only carries that out, so a driver stopped anywhere and run
again creates each step once (what it created is in the ``created`` it reads back).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Set
from dataclasses import dataclass


class ReduceInfeasible(ValueError):
    """The context cannot hold two summaries and a summary's budget: no reduce can run."""


@dataclass(frozen=True, slots=True)
class ReduceStep:
    """One reduce: the node it makes from the summaries of its children, in their order."""

    node: int
    children: tuple[int, ...]
    level: int
    """1 for a step over map summaries only; one more than its deepest child otherwise."""


@dataclass(frozen=True, slots=True)
class ReducePlan:
    chunks: int
    fan_in: int
    steps: tuple[ReduceStep, ...]
    """In the order they can run (a step after all steps it reads)."""

    @property
    def root(self) -> int:
        """The node whose summary is the document's."""
        return self.steps[-1].node if self.steps else 0

    @property
    def depth(self) -> int:
        """Levels of reduce above the map (0: a document of one chunk)."""
        return self.steps[-1].level if self.steps else 0

    @property
    def nodes(self) -> int:
        return self.chunks + len(self.steps)


def fan_in(text_tokens: int, summary_tokens: int, separator_tokens: int = 4) -> int:
    """How many summaries one reduce prompt holds, each up to ``summary_tokens`` long and
    ``separator_tokens`` between them, in ``text_tokens`` of text."""
    per_summary = summary_tokens + separator_tokens
    fits = text_tokens // per_summary if per_summary > 0 else 0
    if fits < 2:
        raise ReduceInfeasible(
            f"{text_tokens} tokens of text hold {fits} summaries of up to {summary_tokens} "
            "tokens: a reduce needs two; ask for shorter summaries or a longer context"
        )
    return fits


def _groups(count: int, size: int) -> list[range]:
    """``range(count)`` cut into the fewest consecutive groups of at most ``size``, as even
    as can be."""
    groups = math.ceil(count / size)
    base, extra = divmod(count, groups)
    cuts, start = [], 0
    for g in range(groups):
        end = start + base + (1 if g < extra else 0)
        cuts.append(range(start, end))
        start = end
    return cuts


def plan_reduce(chunks: int, fan_in: int) -> ReducePlan:
    """The reduce tree over ``chunks`` map summaries, at most ``fan_in`` read per step."""
    if chunks < 1:
        raise ValueError(f"a document has at least one chunk, not {chunks}")
    if fan_in < 2:
        raise ReduceInfeasible(f"a reduce step reads at least two summaries, not {fan_in}")
    frontier: list[tuple[int, int]] = [(node, 0) for node in range(chunks)]  # (node, level)
    steps: list[ReduceStep] = []
    following = chunks
    while len(frontier) > 1:
        above: list[tuple[int, int]] = []
        for group in _groups(len(frontier), fan_in):
            members = frontier[group.start : group.stop]
            if len(members) == 1:
                above.append(members[0])
                continue
            level = 1 + max(level for _, level in members)
            steps.append(ReduceStep(following, tuple(node for node, _ in members), level))
            above.append((following, level))
            following += 1
        frontier = above
    return ReducePlan(chunks, fan_in, tuple(steps))


def ready_steps(plan: ReducePlan, finished: Set[int], created: Iterable[int]) -> list[ReduceStep]:
    """The steps to create now: not created yet, every child finished."""
    made = set(created)
    return [
        step
        for step in plan.steps
        if step.node not in made and all(child in finished for child in step.children)
    ]
