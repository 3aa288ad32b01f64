"""What one claimed item will run, and whether it may: the checks before any engine work.

An item runs either its own request or, after a preemption, the request that continues from
its partial output (a :class:`RunPlan`; the worker builds it, ``worker.prepare.run_plan``).
Whatever runs is what gets counted and reserved: the resumed prompt carries the partial
output as re-tokenized text, whose count can differ from the tokens generated, so it is
counted as the engine will see it, not derived. An item whose line gave no output budget has
its run's budget fitted to that count (:func:`fit_output`), and the request says so.

:func:`judge` takes what counting an item came to (a :class:`CheckedItem`, or the error that
stopped the count) and says what becomes of it: it starts, it fails (refused, or out of
attempts), it goes back to the queue, or it expires because it cannot finish in time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
from backfill.output_budget import fitted_output, with_output_budget
from backfill.prefill import PromptCount
from backfill.refusals import InvalidRequest
from backfill.reservations import reservation_tokens
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
    max_output: int | None = None
    """What this run may generate where :func:`fit_output` fitted it to the prompt (the line
    gave no budget), as ``request`` says; below 1 where the prompt leaves no room. None: what
    is left of the item's budget."""


def run_output(item: ClaimedItem, run: RunPlan) -> int:
    """What ``run`` of ``item`` may generate, per sequence."""
    if not item.max_output_tokens:
        return 0  # an embedding: it holds its prompt alone
    if run.max_output is not None:
        return run.max_output
    return max(1, item.max_output_tokens - run.kept)


def fit_output(item: ClaimedItem, run: RunPlan, count: PromptCount, limit: int) -> RunPlan:
    """``run`` as it goes to the engine. An item whose line gave no output budget may generate
    what is left of the budget stored at ingest (the default at most), cut to what ``limit``
    leaves its exact prompt (the longest sequence's), and its request carries that in the
    field the engine obeys: the reservation covers exactly what the engine may generate (as
    OpenAI and vLLM give a request without a budget what the context leaves). Any other run
    is returned as it is: a budget the caller gave is theirs, and over the limit it fails."""
    if not item.output_defaulted or not item.max_output_tokens or run.complete:
        return run
    room = fitted_output(item.max_output_tokens - run.kept, limit, count.longest)
    if room < 1:
        return replace(run, max_output=room)  # refused by over_limit: nothing is sent
    return replace(
        run, request=with_output_budget(item.endpoint, run.request, room), max_output=room
    )


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
        return run_output(self.item, self.run)

    def reservation(self, block_size: int) -> int:
        """The worst case this run can hold: every sequence's prompt and output, in blocks."""
        return reservation_tokens(
            self.count.longest, self.max_output, block_size, self.count.sequences
        )


def over_limit(
    count: PromptCount, max_output: int, limit: int, *, fitted: bool = False
) -> str | None:
    """Why a run breaks the class limit (per sequence), or None. A ``fitted`` run (its line
    gave no budget, :func:`fit_output`) breaks it only where its prompt leaves no room."""
    if fitted and max_output < 1:
        return (
            f"the prompt ({count.longest} tokens) leaves no room for output within the batch "
            f"limit of {limit} tokens per sequence"
        )
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
    return checked.count.total / prefill_tokens_per_s + checked.max_output / decode_tokens_per_s


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
    refused = over_limit(
        counted.count,
        counted.max_output,
        limits.max_sequence_tokens,
        fitted=counted.run.max_output is not None,
    )
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
