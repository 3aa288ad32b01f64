"""What one claimed item will run, decided before any engine work.

An item runs either its own request or, after a preemption, the request that continues from
its partial output (``resume_request``). Whatever runs is what gets counted and reserved: the
resumed prompt carries the partial output as re-tokenized text, whose count can differ from
the tokens generated, so it is counted as the engine will see it, not derived.

Pure: the dispatcher counts (``count_prefill``) and acts; this module decides.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from backfill.policy import reservation_tokens
from backfill.prefill import PromptCount
from backfill.store import ClaimedItem
from worker.engine import ResumeUnsupported, resume_request


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The request an attempt sends, and the output it continues from."""

    request: dict[str, Any]
    """The body sent to the engine (``model`` is set when it is sent)."""
    kept: int
    """Output tokens of earlier attempts this run continues from (0: from the start)."""
    complete: bool = False
    """Earlier attempts produced the whole answer: nothing is left to run."""


def run_plan(item: ClaimedItem, *, from_start: bool = False) -> RunPlan:
    """The request ``item``'s next attempt sends: its own, or (with partial output and
    unless ``from_start``) its continuation. Raises ``ValueError`` for a body that is not a
    JSON object."""
    body = json.loads(item.body)
    if not isinstance(body, dict):
        raise ValueError("the stored request body is not a JSON object")
    done = item.partial_tokens
    if from_start or not done:
        return RunPlan(body, 0)
    if done >= item.max_output_tokens:
        return RunPlan(body, done, complete=True)
    try:
        return RunPlan(resume_request(item.endpoint, body, item.partial_output or "", done), done)
    except ResumeUnsupported:
        # Continuing would change the answer's meaning: run it whole again.
        return RunPlan(body, 0)


@dataclass(frozen=True, slots=True)
class Prepared:
    """A claimed item, counted and checked, ready to reserve."""

    item: ClaimedItem
    run: RunPlan
    count: PromptCount
    """Of ``run.request``: what the engine will prefill."""
    prompt_tokens: int
    """The original prompt's tokens (usage reports them; a resumed run's prompt also holds
    the partial output)."""

    @property
    def max_output(self) -> int:
        if not self.item.max_output_tokens:
            return 0  # an embedding: it holds its prompt alone
        return max(1, self.item.max_output_tokens - self.run.kept)

    def reservation(self, block_size: int) -> int:
        """The worst case this run can hold: every sequence's prompt and output, in blocks."""
        return reservation_tokens(
            self.count.longest, self.max_output, block_size, self.count.sequences
        )


def over_limit(count: PromptCount, max_output: int, limit: int) -> str | None:
    """Why a run breaks the class limit (per sequence), or None."""
    total = count.longest + max_output
    if total <= limit:
        return None
    return (
        f"prompt ({count.longest} tokens) + max_tokens ({max_output}) = {total} exceeds "
        f"the batch limit of {limit} tokens"
    )


def seconds_needed(
    prepared: Prepared, prefill_tokens_per_s: float, decode_tokens_per_s: float
) -> float:
    """A run's expected time: its prefill, then its output one token per step (sequences
    decode side by side)."""
    return (
        prepared.count.total / prefill_tokens_per_s
        + (prepared.item.max_output_tokens - prepared.run.kept) / decode_tokens_per_s
    )
