"""An interactive request's shape as the gateway reads it from the body (prompts, their bytes,
sequences, ``max_tokens``), before anything is counted: the inputs of the cheap bound, the
key of the template-overhead cache and the upper bound on the prompt's tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from backfill.content_parts import MEDIA_REFUSED, MediaPolicy, media_part
from backfill.prefill import prefill_plan
from backfill.refusals import InvalidRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""What vLLM and OpenAI generate for a ``/v1/completions`` request without ``max_tokens``."""


class InteractiveEndpoint(StrEnum):
    """The endpoints the gateway serves."""

    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class RequestShape:
    """What admission needs from a chat or completions body."""

    endpoint: InteractiveEndpoint
    model: str
    stream: bool
    include_usage: bool
    """The caller asked for the final usage chunk (``stream_options.include_usage``)."""
    longest_prompt_bytes: int
    """UTF-8 bytes of the (longest) prompt's text: the cheap bound's input."""
    token_id_prompt_tokens: int | None
    """Exact tokens when the prompt is given as token ids (no tokenizing needed)."""
    text_prompts: tuple[str, ...]
    """Completions prompts given as text (each counted separately); empty for chat."""
    prompts: int
    n: int
    """Sequences per prompt (``max(n, best_of)``)."""
    max_output_tokens: int | None
    """As the caller gave it; None when absent."""
    budget_key: str
    """The body field that carries the output budget."""
    bound_key: tuple[str, ...] | None = None
    """What the tokens around the prompt's text depend on (see :func:`bound_key`); None when
    only an exact count is safe."""
    segments: int = 1
    """Pieces of text in the (longest) prompt: one per chat message, one for a prompt."""

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def prompt_param(self) -> str:
        return "messages" if self.endpoint is InteractiveEndpoint.CHAT_COMPLETIONS else "prompt"


def _positive_int(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{key} must be a positive integer", param=key)
    return value


def _content_bytes(content: object) -> int:
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += len(part["text"].encode())
        return total
    return 0


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def parse_request(
    endpoint: InteractiveEndpoint, body: object, media: MediaPolicy = MEDIA_REFUSED
) -> RequestShape:
    """The shape of a chat or completions request, whose chat parts ``media`` lets through
    (text only by default); raises :class:`InvalidRequest`."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", param="model")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = bool(stream and isinstance(options, Mapping) and options.get("include_usage"))
    n = max(_positive_int(body, "n", 1) or 1, _positive_int(body, "best_of", 1) or 1)
    text_prompts: tuple[str, ...] = ()
    ids: int | None = None
    if endpoint is InteractiveEndpoint.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty array", param="messages")
        if not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequest("each message must be an object", param="messages")
        refused = media_part(messages, "messages", media)
        if refused is not None:
            raise InvalidRequest(refused, param="messages")
        longest = sum(_content_bytes(m.get("content")) for m in messages)
        prompts = 1
        key = "max_tokens"
        if body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
    else:
        prompt = body.get("prompt")
        prompts = 1
        if isinstance(prompt, str):
            text_prompts = (prompt,)
        elif _is_token_ids(prompt) and prompt:
            ids = len(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            text_prompts = tuple(prompt)
            prompts = len(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_token_ids(p) and p for p in prompt):
            ids = max(len(p) for p in prompt)
            prompts = len(prompt)
        else:
            raise InvalidRequest(
                "prompt must be a string, an array of strings, or token ids", param="prompt"
            )
        longest = max((len(p.encode()) for p in text_prompts), default=0)
        key = "max_tokens"
    max_output = _positive_int(body, key, None)
    # Refuses what no count could cover (prompt embeddings) before any reservation.
    prefill_plan(endpoint.value, body)
    segments = len(body["messages"]) if endpoint is InteractiveEndpoint.CHAT_COMPLETIONS else 1
    return RequestShape(
        endpoint=endpoint,
        model=model,
        stream=stream,
        include_usage=include_usage,
        longest_prompt_bytes=longest,
        token_id_prompt_tokens=ids,
        text_prompts=text_prompts,
        prompts=prompts,
        n=n,
        max_output_tokens=max_output,
        budget_key=key,
        bound_key=bound_key(endpoint, body) if ids is None else None,
        segments=segments,
    )


# Request fields that change what is rendered around the text: a request with any of them is
# counted exactly. Messages with more than a role and plain-text content are too.
_CHAT_RENDERING_FIELDS = (
    "tools",
    "functions",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "reasoning_effort",
)
_COMPLETIONS_RENDERING_FIELDS = ("suffix",)


def bound_key(endpoint: InteractiveEndpoint, body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """What the tokens a tokenizer or chat template adds around a prompt's text depend on:
    ``("prompt",)`` for a completions prompt (the tokenizer's special tokens), ``("chat",
    add_generation_prompt, role, role, ...)`` for chat messages of plain text. None when a
    field could render more than that (tools, documents, template arguments, a custom
    template, content parts, named or tool messages): such requests are counted exactly."""
    if endpoint is InteractiveEndpoint.COMPLETIONS:
        if any(body.get(f) for f in _COMPLETIONS_RENDERING_FIELDS):
            return None
        return ("prompt",)
    if any(body.get(f) for f in _CHAT_RENDERING_FIELDS):
        return None
    generation = body.get("add_generation_prompt", True)
    if not isinstance(generation, bool):
        return None
    roles: list[str] = []
    for message in body["messages"]:
        role, content = message.get("role"), message.get("content")
        if set(message) - {"role", "content"} or not isinstance(role, str):
            return None
        if not isinstance(content, str):
            return None
        roles.append(role)
    return ("chat", str(generation), *roles)


BOUND_MARGIN_PER_SEGMENT = 2
"""Tokens allowed per piece of text beyond one per UTF-8 byte: a SentencePiece tokenizer may
split off a word-start marker, and text meeting template text may tokenize apart."""


def prompt_upper_bound(shape: RequestShape, overhead_tokens: int) -> int:
    """Tokens the (longest) prompt has at most, without tokenizing it: one per UTF-8 byte of
    its text (no token of a byte-level or byte-fallback vocabulary is shorter, special tokens
    aside, and those only shorten), plus what the tokenizer or chat template adds around the
    text (``overhead_tokens``, measured once on the same shape with empty text), plus a
    margin per piece of text."""
    return shape.longest_prompt_bytes + overhead_tokens + BOUND_MARGIN_PER_SEGMENT * shape.segments
