"""What the worker adds to the engine client (``backfill.engine``): continuing a preempted
request from its partial output."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from backfill.engine.protocol import Endpoint, EngineError
from backfill.request_fields import as_integer

__all__ = ["RESUMABLE", "ResumeUnsupported", "resumable", "resume_request"]

RESUMABLE = frozenset({Endpoint.COMPLETIONS, Endpoint.CHAT_COMPLETIONS})
"""The endpoints whose preempted requests continue from their partial output. An embedding
has no output; a Responses request runs again from the start (``worker.responses``)."""


class ResumeUnsupported(EngineError):
    """A preempted request cannot be continued from its partial output; rerun it whole."""


def resumable(endpoint: Endpoint | str) -> bool:
    """Whether a preempted request on ``endpoint`` continues from its partial output."""
    return endpoint in RESUMABLE


def resume_request(
    endpoint: Endpoint | str,
    body: Mapping[str, Any],
    partial_text: str,
    generated_tokens: int,
) -> dict[str, Any]:
    """The request that continues ``body`` after a preemption, from its partial output.

    ``body`` is the item's **original** request and ``partial_text`` everything generated
    for it so far (across earlier preemptions too); ``generated_tokens`` is the engine's count
    of those tokens. The result's ``max_tokens`` is what is left of the original budget, so
    ``generated_tokens`` plus the continuation's completion tokens never exceed it. The final
    output is ``partial_text`` followed by the continuation's text.

    * ``/v1/completions``: the prompt becomes prompt + partial text.
    * ``/v1/chat/completions``: the partial text becomes a final assistant message that the
      model continues (``continue_final_message``, no new generation prompt).

    The continuation's prompt is re-tokenized from text, so its token count may differ by a
    token or so from original prompt + generated tokens at the seam: reserve on the new
    request's own count.

    Raises :class:`ResumeUnsupported` where continuing would change the result's meaning:
    several choices (``n > 1``), ``echo``, token-id prompts, or no budget left.
    """
    path = Endpoint(endpoint)
    if path not in RESUMABLE:
        raise ResumeUnsupported(f"{path.value} requests are not resumed: they run again whole")
    if generated_tokens < 0:
        raise ValueError(f"generated_tokens must not be negative, got {generated_tokens}")
    request = copy.deepcopy(dict(body))
    # Bodies stored before validation normalised their numbers may hold "3.0" and the like:
    # read them as the engine does, and run from the start what cannot be read.
    for key in ("n", "best_of", "max_tokens", "max_completion_tokens", "min_tokens"):
        value = request.get(key)
        if value is not None:
            number = as_integer(value)
            if number is None:
                raise ResumeUnsupported(f"{key} {value!r} is not an integer")
            request[key] = number
    if (request.get("n") or 1) != 1 or (request.get("best_of") or 1) != 1:
        raise ResumeUnsupported("cannot resume a request with several choices (n > 1)")
    # A chat request may name its budget either way; keep whichever it used.
    budget_key = "max_tokens"
    if path is Endpoint.CHAT_COMPLETIONS and request.get("max_completion_tokens") is not None:
        budget_key = "max_completion_tokens"
    budget = request.get(budget_key)
    if budget is None and path is Endpoint.COMPLETIONS:
        budget = 16  # the OpenAI and vLLM default for completions
    if budget is not None:
        remaining = int(budget) - generated_tokens
        if remaining <= 0:
            raise ResumeUnsupported(
                f"nothing left to generate: {generated_tokens} of {budget} tokens done"
            )
        request[budget_key] = remaining
    if request.get("min_tokens"):
        request["min_tokens"] = max(0, int(request["min_tokens"]) - generated_tokens)

    if path is Endpoint.COMPLETIONS:
        if request.get("echo"):
            raise ResumeUnsupported("cannot resume an echo request: the prompt would change")
        prompt = request.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ResumeUnsupported("only a single text prompt can be resumed from text")
        request["prompt"] = prompt + partial_text
        return request

    messages = list(request.get("messages") or ())
    if not messages:
        raise ResumeUnsupported("a chat request without messages cannot be resumed")
    messages.append({"role": "assistant", "content": partial_text})
    request["messages"] = messages
    request["continue_final_message"] = True
    request["add_generation_prompt"] = False
    return request
