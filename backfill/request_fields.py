"""Request fields in one canonical form, before a request is stored.

vLLM's request models are lax: ``"min_tokens": "3.0"``, ``3.0`` and ``"3"`` are all the
integer 3 to the engine, and ``"false"`` is False. Backfill reads some of these fields itself
(resuming a preempted item recomputes ``min_tokens`` and the output budget; counting a chat
prompt passes ``add_generation_prompt`` on), so a stored body must hold exactly what the
engine will understand, in JSON's own types. :func:`normalise_fields` stores an integral
number as an integer (``3.0`` -> ``3``) and refuses, with a message naming the field, what
OpenAI's API refuses: numbers written as strings, booleans as numbers, non-finite numbers, and
anything but a JSON boolean for the fields that shape the prompt. :func:`as_integer` reads a
value as the engine would, for bodies stored before this check existed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

INTEGER_FIELDS = (
    "max_tokens",
    "max_completion_tokens",
    "min_tokens",
    "n",
    "best_of",
    "seed",
    "top_k",
    "top_logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)
"""Fields vLLM reads as integers (``logprobs`` too on completions, a boolean on chat). Each
rule below is a tuple, not a set: a line with several bad fields is refused naming the first
in this order, in every process (a set's order hangs on the process's string hashing)."""

NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "length_penalty",
)

PROMPT_SHAPING_FLAGS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "echo",
)
"""Booleans that change what is prefilled: only true or false, so that Backfill's count and
the engine's rendering cannot read them differently."""


def as_integer(value: Any) -> int | None:
    """``value`` as the integer vLLM reads it as, or None (bools are not integers here)."""
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    if type(value) is str:
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            pass
        try:
            number = float(text)
        except ValueError:
            return None
        if math.isfinite(number) and number.is_integer() and "e" not in text.lower():
            return int(number)
    return None


def _strict_integer(value: Any) -> int | None:
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _strict_number(value: Any) -> int | float | None:
    if type(value) is int or (type(value) is float and math.isfinite(value)):
        return value
    return None


_NumericRule = tuple[tuple[str, ...], Callable[[Any], int | float | None], str]
"""Fields, how each is read strictly (None: refused), and what the refusal says it must be."""


def normalise_fields(body: dict[str, Any], *, chat: bool) -> tuple[str, str] | None:
    """Rewrite ``body``'s numeric fields in place to JSON numbers; returns ``(param,
    message)`` for the first field that is not what the engine would take, else None."""
    integers = INTEGER_FIELDS if chat else (*INTEGER_FIELDS, "logprobs")
    numeric: tuple[_NumericRule, ...] = (
        (integers, _strict_integer, "an integer"),
        (NUMBER_FIELDS, _strict_number, "a finite number"),
    )
    for keys, read, kind in numeric:
        for key in keys:
            value = body.get(key)
            if value is None:
                continue
            number = read(value)
            if number is None:
                return key, f"body.{key} must be {kind} (got {type(value).__name__})"
            body[key] = number
    for key in PROMPT_SHAPING_FLAGS:
        if key in body and body[key] is not None and type(body[key]) is not bool:
            return key, f"body.{key} must be true or false"
    logprobs = body.get("logprobs")
    if chat and logprobs is not None and type(logprobs) is not bool:
        return "logprobs", "body.logprobs must be true or false"
    return None
