"""What becomes of a claimed item or an attempt that does not go on: the values the plans
return, and when a failed attempt is tried again or fails the item.

A plan returns one of :class:`GiveBack` (to the queue, now or later), :class:`Fail` (with the
error line the error file gets) or :class:`Expire`; the worker's loop writes it (fenced by the
attempt) and counts it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum

from backfill.engine.protocol import EngineRejected
from backfill.results import http_error_record
from backfill.states import ItemState


@dataclass(frozen=True, slots=True)
class GiveBack:
    """The item goes back to ``state`` (queued, or deferred for want of slack), to be tried
    again after ``retry_after_s`` (None: at once)."""

    detail: str
    state: ItemState = ItemState.QUEUED
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Fail:
    """The item fails with ``error`` (a JSON error record)."""

    error: str


@dataclass(frozen=True, slots=True)
class Expire:
    """The item cannot finish before its deadline: it expires unstarted."""

    reason: str


def error_json(code: str, message: str) -> str:
    return json.dumps({"code": code, "message": message})


def engine_refusal(exc: EngineRejected, code: str = "engine_rejected") -> str:
    """An engine's 4xx as the error file writes HTTP errors (its own error object kept)."""
    return http_error_record(exc.status, code, exc.message, error=exc.error)


def backoff_s(attempt: int) -> float:
    """How long an item whose attempt failed on its own account waits before the next."""
    return float(min(0.25 * 2 ** max(attempt - 1, 0), 5.0))


class FailureKind(StrEnum):
    """Whose trouble ended an attempt: it decides the retry's delay and the messages."""

    PROMPT = "prompt"
    """The item's prompt could not be counted (not the engine's absence): it fails the same
    way each time, so it backs off."""
    WORKER = "worker"
    """The attempt broke on something of the worker's or the item's: it backs off."""
    ENGINE = "engine"
    """The engine failed the attempt: tried again at once (claiming itself waits while the
    engine is down)."""


def retry_or_fail(
    attempt: int, max_attempts: int, kind: FailureKind, cause: BaseException
) -> GiveBack | Fail:
    """An attempt failed for ``cause``: try the item again (backing off where the trouble is
    its own, so a poison item does not hold the head of the queue), or fail it once this was
    its ``max_attempts``-th attempt."""
    if kind is FailureKind.ENGINE:
        detail = f"engine error: {cause}"
        exhausted = f"the engine failed {attempt} attempts; last error: {cause}"
        retry_after: float | None = None
    else:
        detail = (
            f"the prompt could not be counted: {cause!r}"
            if kind is FailureKind.PROMPT
            else f"worker error: {cause!r}"
        )
        last = detail if kind is FailureKind.PROMPT else repr(cause)
        exhausted = f"{attempt} attempts failed; last error: {last}"
        retry_after = backoff_s(attempt)
    if attempt >= max_attempts:
        return Fail(error_json("retries_exhausted", exhausted))
    return GiveBack(detail, ItemState.QUEUED, retry_after)
