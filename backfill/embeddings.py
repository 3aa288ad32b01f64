"""What an embeddings batch line's body may hold (``/v1/embeddings``), checked before it is
stored.

An embedding generates nothing: the engine prefills each input once and pools it, so its
reservation is its prompt alone, one sequence per input (``backfill.prefill``). That only holds
for bodies whose prefill Backfill can count, so a body is checked against an allowlist: OpenAI's
parameters, and the vLLM extras that neither add to the prefill nor change what the result line
holds. Anything else (``max_tokens``, ``stream``, ``n``, ``messages``, ``padding``,
``priority``, ...) is refused with a message naming it, as OpenAI's API refuses an unrecognised
argument.

Pure: no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

OPENAI_PARAMETERS = ("model", "input", "encoding_format", "dimensions", "user")
VLLM_PARAMETERS = (
    "add_special_tokens",
    "truncate_prompt_tokens",
    "truncation_side",
    "use_activation",
    "embed_dtype",
    "endianness",
    "cache_salt",
)
"""vLLM's own embeddings parameters a batch line may use: ``truncate_prompt_tokens`` only
shortens the prefill Backfill counts whole, the rest shape the tokens (``add_special_tokens``,
counted as the engine counts it) or the vector's encoding."""

PARAMETERS = frozenset(OPENAI_PARAMETERS + VLLM_PARAMETERS)

ENCODING_FORMATS = ("float", "base64")
"""OpenAI's; vLLM's ``bytes`` forms answer with a binary body no result line can hold."""

_CHOICES: dict[str, tuple[str, ...]] = {
    "encoding_format": ENCODING_FORMATS,
    "truncation_side": ("left", "right"),
}
_STRINGS = ("user", "embed_dtype", "endianness", "cache_salt")
_FLAGS = ("add_special_tokens", "use_activation")


@dataclass(frozen=True, slots=True)
class BodyError:
    """Why a body is refused, as a line error's fields."""

    code: str
    param: str
    message: str


def _integer(value: Any) -> int | None:
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def check_embedding_body(body: dict[str, Any]) -> BodyError | None:
    """Refuse what an embeddings line's ``body`` may not hold; integral numbers are rewritten
    in place as integers (``dimensions: 8.0`` -> ``8``). ``model`` and ``input`` are checked
    by the caller, with the other endpoints' prompts."""
    unknown = sorted(key for key in body if key not in PARAMETERS)
    if unknown:
        key = unknown[0]
        return BodyError(
            "unsupported_parameter",
            key,
            f"body.{key} is not a parameter of /v1/embeddings in a batch; a line may give "
            + ", ".join(OPENAI_PARAMETERS + VLLM_PARAMETERS),
        )
    for key, choices in _CHOICES.items():
        value = body.get(key)
        if value is not None and value not in choices:
            return BodyError(
                "invalid_parameter",
                key,
                f"body.{key} must be one of " + ", ".join(repr(c) for c in choices),
            )
    for key in _STRINGS:
        value = body.get(key)
        if value is not None and type(value) is not str:
            return BodyError("invalid_parameter", key, f"body.{key} must be a string")
    for key in _FLAGS:
        value = body.get(key)
        if value is not None and type(value) is not bool:
            return BodyError("invalid_parameter", key, f"body.{key} must be true or false")
    dimensions = body.get("dimensions")
    if dimensions is not None:
        number = _integer(dimensions)
        if number is None or number < 1:
            return BodyError(
                "invalid_parameter", "dimensions", "body.dimensions must be a positive integer"
            )
        body["dimensions"] = number
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None:
        number = _integer(truncate)
        if number is None or (number < 1 and number != -1):
            return BodyError(
                "invalid_parameter",
                "truncate_prompt_tokens",
                "body.truncate_prompt_tokens must be a positive integer, or -1 (the model's "
                "length)",
            )
        body["truncate_prompt_tokens"] = number
    return None
