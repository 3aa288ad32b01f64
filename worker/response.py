"""The non-streaming answer, assembled from the engine's stream (pure: events in, body out).

Batch requests stream from the engine (so the worker sees progress, can be preempted and can
resume), but a batch result line holds the body the endpoint would have sent without
streaming. :class:`ResponseAssembler` folds the stream's events into that body as vLLM's own
non-streaming path builds it: per choice the text, the chat message's ``tool_calls`` (deltas
merged by index: ids and names once, arguments concatenated), ``reasoning``/``refusal``
text, ``logprobs`` (chat: ``content`` entries in order; completions: the four parallel lists),
``finish_reason`` and ``stop_reason``; at the top, ``system_fingerprint`` and any field the
engine sends that is not stream-only.

Text from an earlier attempt (a preempted item resumes from its partial output) is given as
``kept``: it goes in front of the text of this attempt. Logprobs and tool-call deltas of an
earlier attempt are not kept, so a resumed answer's logprobs cover the tokens generated since
the resume (docs/how-it-works.md says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

_STREAM_ONLY = frozenset({"choices", "object", "usage", "id", "created", "model"})
"""Top-level fields of a chunk that the non-streaming body has in its own form."""

_MESSAGE_TEXT = ("content", "reasoning", "reasoning_content", "refusal")
"""Chat delta fields that arrive in pieces and are joined."""

_NULL_MESSAGE: Mapping[str, None] = {
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "reasoning": None,
}
"""Message fields the non-streaming body always has (null unless the stream set them)."""

_COMPLETION_LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    message_text: dict[str, list[str]] = field(default_factory=dict)
    message_other: dict[str, Any] = field(default_factory=dict)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    chat_logprobs: list[Any] | None = None
    completion_logprobs: dict[str, list[Any]] | None = None
    finish_reason: str | None = None
    stop_reason: Any = None

    def add_delta(self, delta: Mapping[str, Any]) -> None:
        for key, value in delta.items():
            if key in _MESSAGE_TEXT:
                if value:
                    self.message_text.setdefault(key, []).append(str(value))
            elif key == "tool_calls":
                for call in value or ():
                    self._add_tool_call(call)
            elif value is not None:
                self.message_other[key] = value

    def _add_tool_call(self, call: Mapping[str, Any]) -> None:
        index = int(call.get("index") or 0)
        merged = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
        )
        if call.get("id"):
            merged["id"] = call["id"]
        if call.get("type"):
            merged["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            merged["function"]["name"] = function["name"]
        if function.get("arguments"):
            merged["function"]["arguments"] += function["arguments"]

    def add_logprobs(self, logprobs: Any, *, chat: bool) -> None:
        if not isinstance(logprobs, Mapping):
            return
        if chat:
            self.chat_logprobs = (self.chat_logprobs or []) + list(logprobs.get("content") or ())
            return
        lists = self.completion_logprobs or {name: [] for name in _COMPLETION_LOGPROBS}
        for name in _COMPLETION_LOGPROBS:
            lists[name].extend(logprobs.get(name) or ())
        self.completion_logprobs = lists


@dataclass(slots=True)
class ResponseAssembler:
    """Fold one attempt's stream events (``add``) into the non-streaming body (``body``)."""

    chat: bool
    choices: dict[int, _Choice] = field(default_factory=dict)
    top: dict[str, Any] = field(default_factory=dict)

    def add(self, event: Mapping[str, Any]) -> None:
        for key, value in event.items():
            if key not in _STREAM_ONLY and value is not None:
                self.top[key] = value
        for raw in event.get("choices") or ():
            choice = self.choices.setdefault(int(raw.get("index") or 0), _Choice())
            if self.chat:
                choice.add_delta(raw.get("delta") or {})
            elif raw.get("text"):
                choice.text.append(str(raw["text"]))
            choice.add_logprobs(raw.get("logprobs"), chat=self.chat)
            if raw.get("finish_reason") is not None:
                choice.finish_reason = raw["finish_reason"]
            if raw.get("stop_reason") is not None:
                choice.stop_reason = raw["stop_reason"]

    def text(self, index: int) -> str:
        """The text this attempt generated for choice ``index``."""
        choice = self.choices.get(index)
        if choice is None:
            return ""
        if self.chat:
            return "".join(choice.message_text.get("content", ()))
        return "".join(choice.text)

    def body(
        self,
        *,
        response_id: str,
        model: str,
        created: int,
        usage: Mapping[str, Any],
        kept: Mapping[int, str] | None = None,
        finish_reason: str | None = None,
    ) -> dict[str, Any]:
        """The body; ``kept`` is earlier attempts' text per choice, ``finish_reason`` what a
        choice that saw none in the stream ends with (``length`` for an answer completed by
        an earlier attempt, else ``stop``)."""
        kept = kept or {}
        indexes = sorted(set(self.choices) | set(kept)) or [0]
        choices = [self._choice(i, kept.get(i, ""), finish_reason) for i in indexes]
        if self.chat:
            head = {"id": f"chatcmpl-{response_id}", "object": "chat.completion"}
        else:
            head = {"id": f"cmpl-{response_id}", "object": "text_completion"}
        return {
            **head,
            "created": created,
            "model": model,
            "choices": choices,
            "system_fingerprint": None,
            **self.top,
            "usage": dict(usage),
        }

    def _choice(self, index: int, kept: str, finish_reason: str | None) -> dict[str, Any]:
        choice = self.choices.get(index) or _Choice()
        finish = choice.finish_reason or finish_reason or "stop"
        if not self.chat:
            logprobs: Any = choice.completion_logprobs
            return {
                "index": index,
                "text": kept + "".join(choice.text),
                "logprobs": logprobs,
                "finish_reason": finish,
                "stop_reason": choice.stop_reason,
            }
        other = dict(choice.message_other)
        message: dict[str, Any] = {"role": other.pop("role", "assistant"), **_NULL_MESSAGE}
        message.update(other)
        joined = {key: "".join(parts) for key, parts in choice.message_text.items()}
        content = kept + joined.pop("content", "")
        message["content"] = content if content or not choice.tool_calls else None
        message.update(joined)
        if choice.tool_calls:  # absent when there are none, as vLLM serializes the message
            message["tool_calls"] = [choice.tool_calls[i] for i in sorted(choice.tool_calls)]
        chat_logprobs = None if choice.chat_logprobs is None else {"content": choice.chat_logprobs}
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs,
            "finish_reason": finish,
            "stop_reason": choice.stop_reason,
        }
