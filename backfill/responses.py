"""What a Responses batch line's body may hold (``/v1/responses``), and the chat prompt vLLM
renders from it.

vLLM serves OpenAI's Responses API on top of its chat machinery: ``instructions`` becomes a
system message, ``input`` (a string, or a list of items) becomes chat messages, function
``tools`` become chat tools, and the chat template renders them
(``vllm/entrypoints/openai/responses/utils.py``: ``construct_input_messages``,
``construct_tool_dicts``; ``protocol.py``: ``ResponsesRequest.build_chat_params``).
:func:`responses_chat` does the same conversion, so the prompt is counted through the
engine's own ``/tokenize`` as a chat prompt is (``backfill.prefill``), and the reservation
covers what the engine prefills.

Only what that conversion covers exactly is accepted: text messages (``input_text`` and
``output_text`` parts) and function tools. Function call items are not: vLLM builds their
chat tool calls as ``{"name", "arguments"}`` and renders them so, while ``/tokenize``
validates chat tool calls into ``{"arguments", "name"}``, and a template that writes the call
as JSON then renders a different prompt (a token longer with a ChatML tool template).
Anything whose prefill Backfill cannot count, or that a stateless batch line cannot do, is a
line error naming the field:

* ``stream``, ``background``: a batch line runs in the batch and its result is a line of the
  output file;
* ``previous_response_id``, ``conversation``: a line is stateless; give the conversation in
  ``input``;
* ``store: true``: responses are not kept for ``GET /v1/responses/{id}`` (vLLM keeps its
  store in the engine's memory, never freed); the result line holds the response. A line
  without ``store`` is stored as ``store: false``;
* built-in tools (web search, file search, MCP, code interpreter, ...), custom and namespace
  tools, function call and reasoning items, images and files: not counted exactly;
* ``priority``, ``request_id``: Backfill's to set.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backfill.refusals import InvalidRequest

__all__ = [
    "FORBIDDEN",
    "PARAMETERS",
    "check_responses_body",
    "responses_chat",
    "responses_text_chars",
]

OPENAI_PARAMETERS = (
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "temperature",
    "top_p",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_tool_calls",
    "text",
    "metadata",
    "user",
    "store",
    "stream",
    "background",
    "reasoning",
    "include",
    "top_logprobs",
    "truncation",
    "service_tier",
    "prompt_cache_key",
)
VLLM_PARAMETERS = (
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "include_reasoning",
    "structured_outputs",
    "chat_template_kwargs",
    "cache_salt",
)
"""vLLM's own Responses parameters a line may use: they shape sampling or the output, or
render into the template (``chat_template_kwargs``, passed to ``/tokenize`` as they are)."""

PARAMETERS = frozenset(OPENAI_PARAMETERS + VLLM_PARAMETERS)

FORBIDDEN: dict[str, str] = {
    "previous_response_id": "a batch line is stateless: give the whole conversation in input",
    "conversation": "a batch line is stateless: give the whole conversation in input",
    "prompt": "prompt templates are not supported: give the text in input and instructions",
    "priority": "Backfill sets the engine priority of batch work",
    "request_id": "Backfill sets the request id of each attempt",
    "previous_input_messages": "a batch line is stateless: give the whole conversation in input",
    "mm_processor_kwargs": "images and files are not supported in batches",
    "media_io_kwargs": "images and files are not supported in batches",
}
"""Fields vLLM takes that a batch line may not give, and why."""

_TRUE_REFUSED: dict[str, str] = {
    "stream": "stream is not supported in batches: the result is a line of the output file",
    "background": "background is not supported in batches: every line runs in the background",
    "store": (
        "store is not supported in batches: the response is kept in the output file, not "
        "for GET /v1/responses/{id} (omit store or set it to false)"
    ),
}
_FLAGS = (
    "parallel_tool_calls",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "include_reasoning",
)
_CALL_ITEMS = (
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
)
_PARTIAL = ("in_progress", "incomplete")
_FUNCTION_KEYS = ("name", "description", "parameters", "strict", "defer_loading")
_DROPPED_WHEN_NONE = ("strict", "defer_loading")


def _refuse(param: str, message: str, code: str = "unsupported_parameter") -> InvalidRequest:
    return InvalidRequest(message, code=code, param=param)


def check_responses_body(body: dict[str, Any]) -> InvalidRequest | None:
    """Refuse what a Responses line's ``body`` may not hold (the allowlist above); writes
    ``store: false`` into a body without ``store``. ``input`` and ``tools`` are checked by
    :func:`responses_chat`, ``max_output_tokens`` by the caller with the other endpoints'
    output budgets."""
    for key in sorted(body):
        if key in FORBIDDEN and body[key] is not None:
            return _refuse(key, f"body.{key} is not supported in batches: {FORBIDDEN[key]}")
    unknown = sorted(k for k in body if k not in PARAMETERS and k not in FORBIDDEN)
    if unknown:
        key = unknown[0]
        return _refuse(
            key,
            f"body.{key} is not a parameter of /v1/responses in a batch; a line may give "
            + ", ".join(OPENAI_PARAMETERS + VLLM_PARAMETERS),
        )
    for key, why in _TRUE_REFUSED.items():
        value = body.get(key)
        if value is None or value is False:
            continue
        if type(value) is not bool:
            return _refuse(key, f"body.{key} must be true or false", "invalid_parameter")
        return _refuse(key, why)
    for key in _FLAGS:
        value = body.get(key)
        if value is not None and type(value) is not bool:
            return _refuse(key, f"body.{key} must be true or false", "invalid_parameter")
    for key in ("instructions", "user", "cache_salt", "prompt_cache_key"):
        value = body.get(key)
        if value is not None and type(value) is not str:
            return _refuse(key, f"body.{key} must be a string", "invalid_parameter")
    for key in ("metadata", "text", "reasoning", "chat_template_kwargs"):
        value = body.get(key)
        if value is not None and type(value) is not dict:
            return _refuse(key, f"body.{key} must be an object", "invalid_parameter")
    body.setdefault("store", False)
    return None


def _text_of(content: Any, where: str, part_type: str = "input_text") -> int:
    """Characters of a message's text; raises for content Backfill does not count (parts
    other than ``part_type``: ``input_text`` for what the caller says, ``output_text`` for
    what the model said)."""
    if type(content) is str:
        return len(content)
    if type(content) is not list or not content:
        raise InvalidRequest(
            f"{where}.content must be a string or a non-empty array of text parts",
            param="input",
        )
    chars = 0
    for index, part in enumerate(content):
        kind = part.get("type") if type(part) is dict else None
        if kind != part_type or type(part.get("text")) is not str:
            raise InvalidRequest(
                f"{where}.content[{index}] must be an {part_type} part with a string text "
                f"(got {kind!r}); images, files, audio and refusals are not supported in "
                "batches",
                code="unsupported_parameter",
                param="input",
            )
        chars += len(part["text"])
    return chars


def responses_text_chars(body: Mapping[str, Any]) -> int:
    """Characters of the text a line's ``instructions`` and ``input`` give (a lower bound's
    and the forecasts' measure); raises :class:`InvalidRequest` as :func:`responses_chat`."""
    chars = len(body.get("instructions") or "")
    value = body.get("input")
    if type(value) is str:
        return chars + len(value)
    for index, item in enumerate(_input_items(value)):
        kind = _item_type(item)
        if kind == "message":
            chars += _text_of(item.get("content"), f"body.input[{index}]", _part_type(item))
    return chars


def _input_items(value: Any) -> list[dict[str, Any]]:
    if type(value) is str:
        if not value:
            raise InvalidRequest("body.input must not be empty", param="input")
        return []
    if type(value) is not list or not value:
        raise InvalidRequest(
            "body.input must be a non-empty string or a non-empty array of input items",
            param="input",
        )
    for index, item in enumerate(value):
        where = f"body.input[{index}]"
        if type(item) is not dict:
            raise InvalidRequest(f"{where} must be an object", param="input")
        kind = _item_type(item)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequest(
                    f"{where}.role must be 'user', 'system', 'developer' or 'assistant'",
                    param="input",
                )
            _text_of(item.get("content"), where, _part_type(item))
            content = item.get("content")
            # An assistant's parts make OpenAI's output message: vLLM takes it for one only
            # with its type, and renders its first part alone.
            parts = type(content) is list and role == "assistant"
            if parts and (item.get("type") != "message" or len(item["content"]) != 1):
                raise InvalidRequest(
                    f"{where}: an assistant message with content parts must be of type "
                    "'message' and hold one output_text part (or give its text as a string)",
                    param="input",
                )
            if item.get("status") is not None and not parts:
                # Only an output message's status is read (a partial one is continued); on
                # other messages vLLM's types may drop it, and the prompt with it would differ.
                raise InvalidRequest(
                    f"{where}.status is taken only on an assistant message of type 'message' "
                    "with an output_text part",
                    param="input",
                )
        elif kind in _CALL_ITEMS:
            raise _refuse(
                "input",
                f"{where} is a {kind!r} item, which batches do not support yet: vLLM renders "
                "a Responses function call with its fields in an order /tokenize does not "
                "keep, so its prompt cannot be counted exactly (give the turn as messages)",
            )
        else:
            raise _refuse(
                "input",
                f"{where} is a {kind!r} item, which batches do not support; an item is a message",
            )
    return value


def _part_type(message: dict[str, Any]) -> str:
    return "output_text" if message.get("role") == "assistant" else "input_text"


def _item_type(item: dict[str, Any]) -> Any:
    return item.get("type", "message" if "role" in item else None)


def _message(item: dict[str, Any]) -> dict[str, Any]:
    """vLLM's chat message for one message item. (vLLM merges an assistant's text into the
    message of the tool calls before it; without function call items there is none.)"""
    if item.get("role") == "assistant":
        content = item["content"]
        return {
            "role": "assistant",
            "content": content if type(content) is str else content[0]["text"],
        }
    # vLLM passes the item on as it is, and its chat renderer reads input_text parts as text
    # parts; /tokenize takes the chat form only.
    content = item["content"]
    if type(content) is list:
        content = [{"type": "text", "text": part["text"]} for part in content]
    return {"role": item["role"], "content": content}


def _continues_final(value: Any) -> bool:
    """vLLM's ``should_continue_final_message``: a last message item left in progress or
    incomplete is continued rather than answered."""
    if type(value) is not list or not value:
        return False
    last = value[-1]
    return last.get("role") == "assistant" and last.get("status") in _PARTIAL


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if type(tools) is not list:
        raise InvalidRequest("body.tools must be an array", param="tools")
    rendered = []
    for index, tool in enumerate(tools):
        kind = tool.get("type") if type(tool) is dict else None
        if kind != "function":
            raise _refuse(
                "tools",
                f"body.tools[{index}] is a {kind!r} tool; batches support function tools only "
                "(built-in tools run in the engine's tool server, and custom and namespace "
                "tools are not counted)",
            )
        if type(tool.get("name")) is not str or not tool["name"]:
            raise InvalidRequest(f"body.tools[{index}].name must be a string", param="tools")
        parameters = tool.get("parameters")
        if parameters is not None and type(parameters) is not dict:
            raise InvalidRequest(f"body.tools[{index}].parameters must be an object", param="tools")
        function = {key: tool.get(key) for key in _FUNCTION_KEYS}
        for key in _DROPPED_WHEN_NONE:
            if function[key] is None:
                del function[key]
        rendered.append({"type": "function", "function": function})
    return rendered


def responses_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat request vLLM renders for ``body``: ``messages`` from ``instructions`` and
    ``input`` (its message items), ``tools`` from the function tools, the generation prompt
    unless the last item is continued, ``reasoning.effort`` as ``reasoning_effort``;
    ``chat_template_kwargs`` as given. Raises :class:`InvalidRequest` for what batches do not
    support."""
    value = body.get("input")
    items = _input_items(value)
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if type(value) is str:
        messages.append({"role": "user", "content": value})
    messages.extend(_message(item) for item in items)
    continued = _continues_final(value)
    chat: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": not continued,
        "continue_final_message": continued,
    }
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    if body.get("chat_template_kwargs") is not None:
        chat["chat_template_kwargs"] = body["chat_template_kwargs"]
    return chat
