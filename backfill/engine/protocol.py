"""What Backfill needs from an inference engine, and the engine's failures.

:class:`Engine` is the interface the worker (and the gateway, for counting prompts) code
against; :class:`backfill.engine.http.HttpEngine` implements it over vLLM's OpenAI-compatible
HTTP server. An in-process ``AsyncLLM`` adapter can implement the same protocol later.

Engine failures reach callers as :class:`EngineError` subclasses, never as ``httpx``
exceptions: :class:`EngineUnavailable` (retry later, maybe elsewhere), :class:`EngineRejected`
(the request is at fault: do not retry it unchanged), :class:`EngineFailed` (the engine broke
while serving it).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import Any, Generic, Protocol, Self, TypeVar, runtime_checkable

from backfill.engine_metrics import EngineLoad, EnginePool
from backfill.errors import BackfillError
from backfill.prefill import PrefillPlan, PromptCount

__all__ = [
    "ChoiceDelta",
    "CompletionStream",
    "Endpoint",
    "Engine",
    "EngineError",
    "EngineFailed",
    "EngineRejected",
    "EngineUnavailable",
    "EventStream",
    "ModelInfo",
    "StreamChunk",
    "Usage",
    "count_prefill",
]


class EngineError(BackfillError):
    """The engine could not serve a request."""


class EngineUnavailable(EngineError):
    """The engine cannot be reached or is overloaded (connection refused or reset, timeout,
    502/503/504); the same request may succeed later."""


class EngineRejected(EngineError):
    """The engine refused the request (4xx): it is malformed, too long, or names an unknown
    model. Retrying it unchanged will fail the same way."""

    def __init__(self, status: int, message: str, error: dict[str, Any] | None = None) -> None:
        super().__init__(f"engine rejected the request ({status}): {message}")
        self.status = status
        self.message = message
        self.error = error
        """The engine's own error object (``{"message", "type", "param", "code"}``), if any."""


class EngineFailed(EngineError):
    """The engine failed while serving the request (5xx, or an error event inside a stream)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"engine failed ({status}): {message}")
        self.status = status
        self.message = message


class Endpoint(StrEnum):
    """The endpoints a batch line may target."""

    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"
    """Not generation: one non-streaming call (:meth:`Engine.embed`)."""
    RESPONSES = "/v1/responses"
    """Generation with its own stream of typed events (:meth:`Engine.stream_responses`)."""


@dataclass(frozen=True)
class ModelInfo:
    """A model the engine serves (``/v1/models``)."""

    id: str
    max_model_len: int | None
    root: str | None


@dataclass(frozen=True)
class Usage:
    """Token counts the engine reports; with continuous usage stats, running totals."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclass(frozen=True)
class ChoiceDelta:
    """The new text of one choice in one streamed chunk."""

    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class StreamChunk:
    """One server-sent event of a streaming completion."""

    id: str
    choices: tuple[ChoiceDelta, ...]
    usage: Usage | None
    """Running token counts (vLLM's ``continuous_usage_stats``); the last chunk, with no
    choices, carries the final counts."""
    raw: Mapping[str, Any] = field(repr=False, compare=False)

    @property
    def text(self) -> str:
        """The new text of all choices (for ``n == 1``, the new text)."""
        return "".join(c.text for c in self.choices)

    @property
    def finish_reason(self) -> str | None:
        return next((c.finish_reason for c in self.choices if c.finish_reason), None)


T = TypeVar("T")


class AsyncClosing(ABC):
    """``async with`` over something that owns a resource: leaving the block awaits
    :meth:`aclose`, which each subclass defines."""

    @abstractmethod
    async def aclose(self) -> None:
        """Release what is owned (the response, the connection pool)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class OwnedStream(AsyncClosing, Generic[T]):
    """An async iterator of ``T`` that owns an HTTP response.

    Use it as ``async with engine.stream_completion(...) as stream: async for chunk in
    stream``; leaving the block, breaking out, or cancelling the task closes the response,
    which makes vLLM abort the request and free its KV blocks. Without ``async with``, call
    :meth:`aclose` when done early (a dropped async generator is closed only when garbage
    collected, and its request keeps running until then).
    """

    def __init__(self, items: AsyncIterator[T]) -> None:
        self._items = items

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> T:
        return await self._items.__anext__()

    async def aclose(self) -> None:
        aclose = getattr(self._items, "aclose", None)
        if aclose is not None:
            await aclose()


class CompletionStream(OwnedStream[StreamChunk]):
    """The :class:`StreamChunk` of one streamed completion or chat request."""


class EventStream(OwnedStream[dict[str, Any]]):
    """The JSON events of one streamed request (a Responses stream's
    ``response.output_text.delta``, ``response.completed``, ...)."""


@runtime_checkable
class Engine(Protocol):
    """What the worker needs from its node's engine."""

    async def pool(self) -> EnginePool:
        """The KV pool the engine allocated (measured)."""
        ...

    async def load(self) -> EngineLoad:
        """Running and waiting requests, KV usage, and counters, now."""
        ...

    async def models(self) -> list[ModelInfo]: ...

    async def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], model: str) -> int:
        """Prompt tokens of a chat request, chat template and generation prompt included."""
        ...

    async def tokenize_prompt(self, prompt: str, model: str) -> int:
        """Prompt tokens of a completions request, special tokens included as the engine
        adds them."""
        ...

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        """Prompt tokens of one ``/tokenize`` body (a :class:`backfill.prefill.PrefillPlan`
        entry: a chat rendering with all its arguments, or one completions prompt)."""
        ...

    def stream_completion(
        self,
        endpoint: Endpoint | str,
        body: Mapping[str, Any],
        *,
        priority: int,
        request_id: str,
        stream_interval: int = 1,
    ) -> CompletionStream:
        """Start a streaming generation; lower ``priority`` runs first; output comes in
        chunks of ``stream_interval`` tokens (the first token and the last chunk at once)."""
        ...

    def stream_responses(
        self, body: Mapping[str, Any], *, priority: int, request_id: str
    ) -> EventStream:
        """Start a streaming ``/v1/responses`` generation at ``priority``: its events as the
        engine sends them; ``request_id`` becomes the response's id."""
        ...

    async def embed(
        self, body: Mapping[str, Any], *, priority: int, request_id: str
    ) -> dict[str, Any]:
        """One ``/v1/embeddings`` call, not streamed: the engine's response body. Cancelling
        the awaiting task drops the connection, which makes vLLM abort the request."""
        ...

    async def aclose(self) -> None: ...


async def count_prefill(engine: Engine, plan: PrefillPlan, model: str) -> PromptCount:
    """Carry out ``plan``: the engine counts each prompt given as text (at once), the
    prompts given as token ids are known."""
    counted = await asyncio.gather(*(engine.tokenize(body, model) for body in plan.tokenize))
    return PromptCount.of([*counted, *plan.known], plan.n)
