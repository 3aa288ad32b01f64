"""What one request makes the engine prefill, as the engine itself counts it.

A reservation covers ``round_up(prompt + max_output)`` for **every sequence** a request
creates, so the prompt has to be counted the way the engine will render it, with every field
that adds to it, and the sequences have to be counted too:

* a completions ``prompt`` may be a list: vLLM runs one sequence per entry, each with its
  own prompt; ``n``/``best_of`` multiply them;
* an embeddings ``input`` takes the same four forms (a string, strings, token ids, lists of
  token ids), one sequence per entry, and generates nothing: its prefill is all it holds;
* a chat prompt is what the chat template renders from ``messages`` **and** ``tools``,
  ``documents``, ``chat_template``, ``chat_template_kwargs``, ``add_generation_prompt``,
  ``continue_final_message``, ``reasoning_effort``, ``add_special_tokens`` and the multimodal
  arguments: a 500 KB tool schema is prefilled like any message;
* a Responses prompt (``/v1/responses``) is a chat prompt too: vLLM turns ``instructions``
  and ``input`` into chat messages and the function ``tools`` into chat tools, then renders
  them with the same template (``backfill.responses.responses_chat``), so it is counted as
  the chat rendering of those.

:func:`prefill_plan` turns a body into the ``/tokenize`` bodies that count exactly that (the
engine's own ``/tokenize`` applies the same template with the same arguments), plus the
prompts whose counts are known without asking (token ids). The worker (batch items) and the
gateway (interactive requests) both count through it, so the two paths cannot drift apart.
Fields pass through verbatim where ``/tokenize`` takes them, so the engine interprets them
exactly as it will when it runs the request; the few it does not take are folded into
``chat_template_kwargs`` the way vLLM's chat endpoint folds them.

Pure: no I/O. The engine client carries the plan out
(``backfill.engine.protocol.count_prefill``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backfill.refusals import InvalidRequest
from backfill.responses import responses_chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
EMBEDDINGS = "/v1/embeddings"
RESPONSES = "/v1/responses"

# Chat fields that /tokenize takes as they are and that change the rendered prompt.
_CHAT_TOKENIZE_FIELDS = (
    "tools",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
)
# Fields that render into the chat template as keyword arguments: /tokenize has no field of
# their own, so they go into chat_template_kwargs, over the caller's (vLLM's chat endpoint
# merges them over chat_template_kwargs the same way; unset means None or "auto").
_CHAT_TEMPLATE_ARGUMENTS = ("documents", "reasoning_effort")
_UNSET = (None, "auto")

# Fields that make the engine prefill something no count of the text can see: refused.
_UNCOUNTABLE = ("prompt_embeds",)


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """The prompts one request prefills, and how many sequences each runs."""

    tokenize: tuple[dict[str, Any], ...]
    """``/tokenize`` bodies (without ``model``), one per prompt given as text."""
    known: tuple[int, ...]
    """Exact counts of the prompts given as token ids."""
    n: int
    """Sequences per prompt (``max(n, best_of)``)."""

    @property
    def prompts(self) -> int:
        return len(self.tokenize) + len(self.known)

    @property
    def sequences(self) -> int:
        return self.prompts * self.n


@dataclass(frozen=True, slots=True)
class PromptCount:
    """The counted prompts of one request.

    Reserve ``sequences`` sequences of ``longest + max_output`` each (every sequence charged
    the longest prompt: an upper bound that needs one number per request); ``total`` is what
    the engine's usage reports as prompt tokens and what prefill will compute.
    """

    longest: int
    total: int
    sequences: int

    @classmethod
    def single(cls, tokens: int) -> PromptCount:
        return cls(tokens, tokens, 1)

    @classmethod
    def of(cls, counts: tuple[int, ...] | list[int], n: int = 1) -> PromptCount:
        if not counts or n < 1:
            raise ValueError("a request has at least one prompt and one sequence")
        return cls(max(counts), sum(counts), len(counts) * n)


def _is_token_ids(value: object) -> bool:
    return type(value) is list and bool(value) and all(type(t) is int and t >= 0 for t in value)


def _sequences_per_prompt(body: Mapping[str, Any]) -> int:
    n = body.get("n")
    best_of = body.get("best_of")
    per_prompt = 1
    for key, value in (("n", n), ("best_of", best_of)):
        if value is None:
            continue
        if type(value) is not int or value < 1:
            raise InvalidRequest(f"{key} must be a positive integer", param=key)
        per_prompt = max(per_prompt, value)
    return per_prompt


def _refuse_uncountable(body: Mapping[str, Any]) -> None:
    for key in _UNCOUNTABLE:
        if body.get(key) is not None:
            raise InvalidRequest(
                f"{key} is not supported: Backfill reserves KV for the prompt it can count",
                code="unsupported_parameter",
                param=key,
            )


def chat_tokenize_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` body that renders exactly the prompt ``body`` will prefill."""
    messages = body.get("messages")
    if type(messages) is not list or not messages:
        raise InvalidRequest("messages must be a non-empty array", param="messages")
    request: dict[str, Any] = {"messages": messages}
    for key in _CHAT_TOKENIZE_FIELDS:
        if key in body and body[key] is not None:
            request[key] = body[key]
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InvalidRequest("chat_template_kwargs must be an object", param="chat_template_kwargs")
    merged: dict[str, Any] = dict(kwargs or {})
    for key in _CHAT_TEMPLATE_ARGUMENTS:
        value = body.get(key)
        if value not in _UNSET:
            merged[key] = value
    effort = body.get("reasoning_effort")
    if effort is not None and "enable_thinking" not in (kwargs or {}):
        # vLLM turns thinking on for templates that need it asked when reasoning is asked.
        merged["enable_thinking"] = effort != "none"
    if merged:
        request["chat_template_kwargs"] = merged
    return request


def _prompts(value: object, name: str) -> list[str | list[int]]:
    if type(value) is str:
        return [value]
    if _is_token_ids(value):
        assert isinstance(value, list)
        return [value]
    if type(value) is list and value:
        if all(type(p) is str for p in value):
            return list(value)
        if all(_is_token_ids(p) for p in value):
            return list(value)
    raise InvalidRequest(
        f"{name} must be a string, an array of strings, an array of token ids, or an array "
        "of arrays of token ids",
        param=name,
    )


def completion_prompts(prompt: object) -> list[str | list[int]]:
    """The prompts of a completions ``prompt`` field, one per sequence it runs."""
    return _prompts(prompt, "prompt")


def embedding_inputs(value: object) -> list[str | list[int]]:
    """The inputs of an embeddings ``input`` field, one per sequence it runs (OpenAI's four
    forms; vLLM's chat-message forms are not among them)."""
    return _prompts(value, "input")


def _refuse_embedding_extras(body: Mapping[str, Any]) -> None:
    # vLLM embeds a chat conversation given as ``messages`` (or as ``input``) through the
    # chat template, and pads to the model's length with ``padding: max_length``: neither is
    # what /tokenize counts from ``input``, nor part of OpenAI's API.
    if body.get("messages") is not None:
        raise InvalidRequest(
            "messages is not supported for /v1/embeddings: give the text as input",
            code="unsupported_parameter",
            param="messages",
        )
    if body.get("padding") not in (None, "do_not_pad"):
        raise InvalidRequest(
            "padding is not supported: Backfill reserves KV for the input it can count",
            code="unsupported_parameter",
            param="padding",
        )


def _text_prompts(prompts: list[str | list[int]], special: object, n: int) -> PrefillPlan:
    bodies: list[dict[str, Any]] = []
    known: list[int] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            request: dict[str, Any] = {"prompt": prompt}
            if special is not None:
                request["add_special_tokens"] = special
            bodies.append(request)
        else:
            known.append(len(prompt))
    return PrefillPlan(tuple(bodies), tuple(known), n)


def prefill_plan(endpoint: str, body: Mapping[str, Any]) -> PrefillPlan:
    """The plan that counts what ``body`` on ``endpoint`` prefills; raises
    :class:`InvalidRequest` for a body whose prefill cannot be counted."""
    _refuse_uncountable(body)
    special = body.get("add_special_tokens")
    if endpoint == EMBEDDINGS:
        # vLLM tokenizes an embeddings input as /tokenize tokenizes a prompt (special tokens
        # added unless asked not to); one sequence per input, whatever ``n`` says.
        _refuse_embedding_extras(body)
        return _text_prompts(embedding_inputs(body.get("input")), special, 1)
    if endpoint == RESPONSES:
        # One sequence: a Responses request has no n.
        return PrefillPlan((chat_tokenize_body(responses_chat(body)),), (), 1)
    n = _sequences_per_prompt(body)
    if endpoint == CHAT:
        return PrefillPlan((chat_tokenize_body(body),), (), n)
    if endpoint != COMPLETIONS:
        raise InvalidRequest(f"endpoint {endpoint!r} is not supported", param="url")
    return _text_prompts(completion_prompts(body.get("prompt")), special, n)
