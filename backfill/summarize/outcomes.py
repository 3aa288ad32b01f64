"""What a finished batch item says about its step: the summary and usage of a chat
completion that succeeded, or why the step failed."""

from __future__ import annotations

from typing import Any

from backfill.results import json_or_text
from backfill.summarize.decide import StepView
from backfill.summarize.states import StepState

_ENDED = {"failed", "expired", "cancelled"}


def _storable(text: str) -> str:
    """``text`` without NUL characters, which a Postgres text column refuses (a model may
    emit one: the random-weight test model does): kept, the step's outcome could never be
    stored, and its job would stall on it every round."""
    return text.replace("\x00", "")


def _message(error: Any) -> str:
    if isinstance(error, dict):
        inner = error.get("error", error)
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
    return str(error) if error else "no reason given"


def step_outcome(item_state: str, result: str | None, error: str | None) -> StepView | None:
    """The step's view after its item ended in ``item_state`` (None: not ended yet)."""
    if item_state in _ENDED:
        reason = _storable(_message(json_or_text(error)))
        return StepView(StepState.FAILED, error=f"{item_state}: {reason}")
    if item_state != "succeeded":
        return None
    body = json_or_text(result)
    try:
        choice = body["choices"][0]
        text = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return StepView(StepState.FAILED, error="the response carries no message")
    usage = body.get("usage") or {}
    if isinstance(text, str):
        text = _storable(text)
    if not isinstance(text, str) or not text.strip():
        return StepView(
            StepState.FAILED,
            error="the model returned an empty summary",
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
        )
    return StepView(
        StepState.SUCCEEDED,
        summary=text.strip(),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or 0),
    )
