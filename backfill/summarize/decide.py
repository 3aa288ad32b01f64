"""What the reduce driver does next for a document, decided from what its steps have done.

The server's driver (:mod:`backfill.summarize.driver`) reads a document's steps as they are
in Postgres and asks :func:`decide_document`: which reduce steps to create now (their children
all summarised), or whether the document is finished (its root step summarised: that is its
summary) or failed (a step failed: a summary of part of a document is not a summary of it).
Deciding from the stored state alone, and creating steps keyed by their node, is what lets a
driver killed anywhere run again without losing or doubling a step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from backfill.summarize.reduce_plan import ReducePlan, ReduceStep, plan_reduce, ready_steps
from backfill.summarize.states import DocumentState, StepState


@dataclass(frozen=True, slots=True)
class StepView:
    state: StepState
    summary: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class NewReduce:
    """A reduce step to create: its node, its children, and their summaries in order."""

    step: ReduceStep
    summaries: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DocumentDecision:
    create: tuple[NewReduce, ...] = ()
    ended: DocumentState | None = None
    """Set when the document ends now."""
    summary: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    split_depth: int = 0


def decide_document(
    chunks: int, fan_in: int, steps: Mapping[int, StepView], plan: ReducePlan | None = None
) -> DocumentDecision:
    """The next move for a document of ``chunks`` chunks whose created steps are ``steps``
    (by node)."""
    plan = plan or plan_reduce(chunks, fan_in)
    failed = sorted(node for node, s in steps.items() if s.state is StepState.FAILED)
    usage_in = sum(s.prompt_tokens for s in steps.values())
    usage_out = sum(s.completion_tokens for s in steps.values())
    if failed:
        first = steps[failed[0]]
        where = "map" if failed[0] < chunks else "reduce"
        return DocumentDecision(
            ended=DocumentState.FAILED,
            error=f"{where} step {failed[0]} failed: {first.error or 'no summary'}",
            prompt_tokens=usage_in,
            completion_tokens=usage_out,
            split_depth=plan.depth,
        )
    root = steps.get(plan.root)
    if root is not None and root.state is StepState.SUCCEEDED:
        return DocumentDecision(
            ended=DocumentState.SUCCEEDED,
            summary=root.summary or "",
            prompt_tokens=usage_in,
            completion_tokens=usage_out,
            split_depth=plan.depth,
        )
    finished = {node for node, s in steps.items() if s.state is StepState.SUCCEEDED}
    create = tuple(
        NewReduce(step, tuple(steps[c].summary or "" for c in step.children))
        for step in ready_steps(plan, finished, steps.keys())
    )
    return DocumentDecision(create=create, split_depth=plan.depth)
