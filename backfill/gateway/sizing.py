"""Sizing one interactive request against its class limit and its per-request caps: the cheap
bound before tokenizing, the exact sizing after it, and the body sent upstream with
``max_tokens`` no larger than what was reserved. Pure functions over values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backfill.gateway.refusals import ContextLengthExceeded, OverRequestCap
from backfill.gateway.request import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    InteractiveEndpoint,
    RequestShape,
)


def prompt_lower_bound(shape: RequestShape, max_bytes_per_token: int) -> int:
    """Tokens the (longest) prompt has at least: exact for token ids, else bytes divided by
    the longest token's bytes, rounded up."""
    if shape.token_id_prompt_tokens is not None:
        return shape.token_id_prompt_tokens
    return math.ceil(shape.longest_prompt_bytes / max_bytes_per_token)


def check_bound(
    shape: RequestShape,
    limit: int,
    max_bytes_per_token: int,
    max_request_tokens: int | None = None,
) -> None:
    """Refuse, before tokenizing, what cannot fit ``limit`` (per sequence) or
    ``max_request_tokens`` (over all sequences) even at the prompt's lower bound."""
    lower = prompt_lower_bound(shape, max_bytes_per_token)
    least_output = shape.max_output_tokens or 1
    if (
        max_request_tokens is not None
        and shape.sequences * (lower + least_output) > max_request_tokens
    ):
        raise _over_token_cap(shape, lower, least_output, max_request_tokens, exact=False)
    if lower + least_output > limit:
        what = (
            f"prompt (at least {lower} tokens) + {shape.budget_key} ({least_output})"
            if shape.max_output_tokens
            else f"prompt (at least {lower} tokens)"
        )
        raise ContextLengthExceeded(
            f"This model's maximum context length for interactive requests is {limit} tokens; "
            f"the {what} cannot fit. Shorten the prompt or lower {shape.budget_key}.",
            stage="bound",
            limit=limit,
            param=shape.prompt_param if lower >= limit else shape.budget_key,
        )


@dataclass(frozen=True)
class RequestCaps:
    """What one interactive request may ask for (``BACKFILL_GATEWAY_MAX_SEQUENCES``,
    ``BACKFILL_GATEWAY_MAX_REQUEST_TOKENS``, ``BACKFILL_GATEWAY_MAX_WAIT_CAP_S``)."""

    max_sequences: int
    max_request_tokens: int
    """KV tokens over all of a request's sequences (``sequences x (prompt + max_output)``,
    before block rounding)."""
    max_wait_s: float


def _sequences_param(shape: RequestShape) -> str:
    return "n" if shape.n > 1 else shape.prompt_param


def check_sequences(shape: RequestShape, max_sequences: int) -> None:
    """Refuse, before anything is counted, a request of more sequences than the cap."""
    if shape.sequences <= max_sequences:
        return
    what = f"{shape.prompts} prompts x n={shape.n}" if shape.prompts > 1 else f"n={shape.n}"
    raise OverRequestCap(
        f"This request asks for {shape.sequences} sequences ({what}); an interactive request "
        f"may run at most {max_sequences}. Lower n (or send fewer prompts), or submit the "
        "work as a batch.",
        param=_sequences_param(shape),
        limit=max_sequences,
    )


def _over_token_cap(
    shape: RequestShape, prompt_tokens: int, output: int, cap: int, *, exact: bool
) -> OverRequestCap:
    total = shape.sequences * (prompt_tokens + output)
    prompt = f"{prompt_tokens} prompt" if exact else f"at least {prompt_tokens} prompt"
    # The output budget when lowering it could bring the request under the cap; else the
    # sequences (or the prompt itself).
    param = shape.budget_key if shape.sequences * prompt_tokens < cap else _sequences_param(shape)
    return OverRequestCap(
        f"This request would reserve {total} KV tokens ({shape.sequences} sequence(s) x "
        f"({prompt} + {output} {shape.budget_key})); an interactive request may reserve at "
        f"most {cap}. Lower {shape.budget_key} or n, or submit the work as a batch.",
        param=param,
        limit=cap,
    )


@dataclass(frozen=True)
class Sizing:
    """The reservation one request needs (per sequence; ``sequences`` of them)."""

    prompt_tokens: int
    max_output_tokens: int
    sequences: int
    output_defaulted: bool
    """The caller gave no budget: ``max_output_tokens`` must be sent to the engine."""

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


def size_request(
    shape: RequestShape, prompt_tokens: int, limit: int, max_request_tokens: int | None = None
) -> Sizing:
    """The exact check: ``prompt + max_output <= limit``, with the worst case for an absent
    budget (everything the context leaves, and the request cap allows; 16 for completions),
    and ``sequences x (prompt + max_output) <= max_request_tokens``."""
    given = shape.max_output_tokens
    if given is None and shape.endpoint is InteractiveEndpoint.COMPLETIONS:
        given = COMPLETIONS_DEFAULT_MAX_TOKENS
    output = given if given is not None else limit - prompt_tokens
    if given is None and max_request_tokens is not None:
        # No budget asked for: as much as the cap leaves each sequence (sent to the engine).
        output = min(output, max_request_tokens // shape.sequences - prompt_tokens)
        if output < 1 and prompt_tokens < limit:
            raise _over_token_cap(shape, prompt_tokens, 1, max_request_tokens, exact=True)
    if output < 1 or prompt_tokens + output > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length for interactive requests is {limit} tokens; "
            f"the prompt has {prompt_tokens} tokens"
            + (f" and {shape.budget_key} is {given}" if given is not None else "")
            + f". Shorten the prompt or lower {shape.budget_key}.",
            stage="exact",
            limit=limit,
            param=shape.prompt_param if prompt_tokens >= limit else shape.budget_key,
        )
    if max_request_tokens is not None and shape.sequences * (prompt_tokens + output) > (
        max_request_tokens
    ):
        raise _over_token_cap(shape, prompt_tokens, output, max_request_tokens, exact=True)
    return Sizing(prompt_tokens, output, shape.sequences, shape.max_output_tokens is None)


def upstream_body(
    body: Mapping[str, Any], shape: RequestShape, sizing: Sizing, priority: int
) -> dict[str, Any]:
    """The body sent to the engine: the caller's, at the interactive priority (a caller cannot
    choose its own), with the budget the reservation covers made explicit, and with the final
    usage chunk on a stream (settling needs it; the relay drops it unless asked for)."""
    payload = dict(body)
    payload["priority"] = priority
    if sizing.output_defaulted:
        payload[shape.budget_key] = sizing.max_output_tokens
    if shape.stream:
        options = body.get("stream_options")
        merged = dict(options) if isinstance(options, Mapping) else {}
        merged["include_usage"] = True
        payload["stream_options"] = merged
    return payload
