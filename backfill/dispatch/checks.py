"""What one claimed item will run, and whether it may: the checks before any engine work.

An item runs either its own request or, after a preemption, the request that continues from
its partial output (a :class:`RunPlan`; the worker builds it, ``worker.prepare.run_plan``).
Whatever runs is what gets counted and reserved: the resumed prompt carries the partial
output as re-tokenized text, whose count can differ from the tokens generated, so it is
counted as the engine will see it, not derived.

:func:`judge` takes what counting an item came to (a :class:`CheckedItem`, or the error that
stopped the count) and says what becomes of it: it starts, it fails (refused, or out of
attempts), it goes back to the queue, or it expires because it cannot finish in time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from backfill.dispatch.outcomes import (
    Expire,
    Fail,
    FailureKind,
    GiveBack,
    engine_refusal,
    retry_or_fail,
)
from backfill.engine.protocol import EngineRejected, EngineUnavailable
from backfill.policy import reservation_tokens
from backfill.prefill import PromptCount
from backfill.refusals import InvalidRequest
from backfill.results import http_error_record
from backfill.store import ClaimedItem


@dataclass(frozen=True, slots=True)
class RunPlan:
    """The request an attempt sends, and the output it continues from."""

    request: dict[str, Any]
    """The body sent to the engine (``model`` is set when it is sent)."""
    kept: int
    """Output tokens of earlier attempts this run continues from (0: from the start)."""
    complete: bool = False
    """Earlier attempts produced the whole answer: nothing is left to run."""


@dataclass(frozen=True, slots=True)
class CheckedItem:
    """A claimed item, counted, ready to be checked and reserved."""

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
    checked: CheckedItem, prefill_tokens_per_s: float, decode_tokens_per_s: float
) -> float:
    """A run's expected time: its prefill, then its output one token per step (sequences
    decode side by side)."""
    return (
        checked.count.total / prefill_tokens_per_s
        + (checked.item.max_output_tokens - checked.run.kept) / decode_tokens_per_s
    )


@dataclass(frozen=True, slots=True)
class Limits:
    """What a checked item is held to on this node."""

    max_sequence_tokens: int
    """The batch class limit, per sequence: prompt + max_output."""
    max_attempts: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    """The measured (or assumed) per-sequence decode rate the deadline is judged by."""


@dataclass(frozen=True, slots=True)
class EngineAbsent:
    """The engine could not count (down, overloaded): the item goes back untouched, and the
    node claims nothing more until the engine answers again."""

    give_back: GiveBack


Verdict = CheckedItem | Fail | GiveBack | Expire | EngineAbsent
"""What :func:`judge` decides for one claimed item: a :class:`CheckedItem` starts."""


def judge(
    item: ClaimedItem,
    counted: CheckedItem | BaseException,
    limits: Limits,
    left_s: float,
) -> Verdict:
    """What becomes of ``item``, counted as ``counted``, with ``left_s`` seconds left before
    its deadline (on Postgres' clock, less the time the count took)."""
    if isinstance(counted, EngineRejected):
        return Fail(engine_refusal(counted, "invalid_request"))
    if isinstance(counted, InvalidRequest):
        return Fail(http_error_record(400, counted.code, counted.message, param=counted.param))
    if isinstance(counted, EngineUnavailable):
        return EngineAbsent(GiveBack(f"tokenize failed: {counted}"))
    if isinstance(counted, BaseException):
        # Not the engine's absence but something about this item: it fails the same way each
        # time it is tried, so it counts against the item's attempts.
        return retry_or_fail(item.attempt, limits.max_attempts, FailureKind.PROMPT, counted)
    refused = over_limit(counted.count, counted.max_output, limits.max_sequence_tokens)
    if refused is not None:
        return Fail(http_error_record(400, "context_length_exceeded", refused))
    rate = limits.decode_tokens_per_s
    need_s = seconds_needed(counted, limits.prefill_tokens_per_s, rate)
    if need_s > left_s:
        return Expire(
            f"needs about {need_s:.1f} s at {rate:.1f} tokens/s; "
            f"{max(left_s, 0):.1f} s left before the deadline"
        )
    return counted
