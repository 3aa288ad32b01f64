"""The worker's adapter to its node's inference engine.

:class:`Engine` is the interface the worker codes against; :class:`HttpEngine` implements it
over vLLM's OpenAI-compatible HTTP server (the same on GPU and CPU nodes). An in-process
``AsyncLLM`` adapter can implement the same protocol later.

Three rules the rest of the worker relies on:

* The pool is **measured** from the engine's ``/metrics`` (``vllm:cache_config_info``),
  never computed.
* **Abort = close the stream.** vLLM aborts a request and frees its KV blocks when the client
  disconnects. :class:`CompletionStream` closes its HTTP response when the consuming task is
  cancelled, when the ``async with`` block exits, or on :meth:`CompletionStream.aclose`.
* Engine failures reach callers as :class:`EngineError` subclasses, never as ``httpx``
  exceptions: :class:`EngineUnavailable` (retry later, maybe elsewhere), :class:`EngineRejected`
  (the request is at fault: do not retry it unchanged), :class:`EngineFailed` (the engine broke
  while serving it).
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import TracebackType
from typing import Any, Protocol, Self, runtime_checkable

import httpx

from backfill.capacity import EngineLoad, EnginePool, parse_cache_config, parse_engine_load
from backfill.engine_scheduler import EngineScheduler, parse_scheduler_metrics
from backfill.errors import BackfillError
from backfill.prefill import PrefillPlan, PromptCount
from backfill.request_fields import as_integer

__all__ = [
    "ChoiceDelta",
    "CompletionStream",
    "Endpoint",
    "Engine",
    "EngineError",
    "EngineFailed",
    "EngineRejected",
    "EngineUnavailable",
    "HttpEngine",
    "ModelInfo",
    "ResumeUnsupported",
    "StreamChunk",
    "Usage",
    "resume_request",
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


class ResumeUnsupported(EngineError):
    """A preempted request cannot be continued from its partial output; rerun it whole."""


class Endpoint(StrEnum):
    """The generation endpoints a batch line may target."""

    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"


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


class CompletionStream:
    """An async iterator of :class:`StreamChunk` that owns an HTTP response.

    Use it as ``async with engine.stream_completion(...) as stream: async for chunk in
    stream``; leaving the block, breaking out, or cancelling the task closes the response,
    which makes vLLM abort the request and free its KV blocks. Without ``async with``, call
    :meth:`aclose` when done early (a dropped async generator is closed only when garbage
    collected, and its request keeps running until then).
    """

    def __init__(self, chunks: AsyncIterator[StreamChunk]) -> None:
        self._chunks = chunks

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> StreamChunk:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        aclose = getattr(self._chunks, "aclose", None)
        if aclose is not None:
            await aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


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

    async def aclose(self) -> None: ...


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of a server-sent event stream, split on ``\n`` only.

    httpx's ``aiter_lines`` also splits on U+2028, U+0085 and friends, which JSON leaves
    unescaped inside strings: generated text holding one would cut an event in two.
    """
    pending = ""
    async for text in response.aiter_text():
        pending += text
        *lines, pending = pending.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if pending:
        yield pending.removesuffix("\r")


def _error_message(response: httpx.Response) -> str:
    """vLLM's error text from ``{"error": {"message": ...}}`` or ``{"message": ...}``."""
    try:
        payload = response.json()
    except ValueError:
        return response.text[:1000] or response.reason_phrase
    if isinstance(payload, dict):
        inner = payload.get("error")
        if isinstance(inner, dict) and "message" in inner:
            return str(inner["message"])
        if isinstance(inner, str):
            return inner
        if "message" in payload:
            return str(payload["message"])
        if "detail" in payload:
            return str(payload["detail"])
    return response.text[:1000]


def _raise_for_status(response: httpx.Response, message: str) -> None:
    status = response.status_code
    if status < 400:
        return
    if status in {502, 503, 504}:
        raise EngineUnavailable(f"engine answered {status}: {message}")
    if status < 500:
        raise EngineRejected(status, message, _error_object(response))
    raise EngineFailed(status, message)


def _error_object(response: httpx.Response) -> dict[str, Any] | None:
    try:
        payload = response.json()
    except ValueError:
        return None
    inner = payload.get("error") if isinstance(payload, dict) else None
    return inner if isinstance(inner, dict) else None


def _usage(raw: object) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    prompt = int(raw.get("prompt_tokens") or 0)
    completion = int(raw.get("completion_tokens") or 0)
    return Usage(prompt, completion, int(raw.get("total_tokens") or prompt + completion))


def _chunk(event: Mapping[str, Any]) -> StreamChunk:
    choices = []
    for choice in event.get("choices") or ():
        # Completions carry ``text``; chat carries ``delta.content`` (absent on the role-only
        # first chunk and the finishing chunk).
        delta = choice.get("delta")
        text = choice.get("text") if delta is None else (delta.get("content") or "")
        choices.append(
            ChoiceDelta(
                index=int(choice.get("index") or 0),
                text=text or "",
                finish_reason=choice.get("finish_reason"),
                stop_reason=choice.get("stop_reason"),
            )
        )
    return StreamChunk(
        id=str(event.get("id", "")),
        choices=tuple(choices),
        usage=_usage(event.get("usage")),
        raw=event,
    )


class HttpEngine:
    """:class:`Engine` over a vLLM OpenAI-compatible server at ``base_url``."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        stream_read_timeout_s: float | None = None,
        max_connections: int = 512,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        """``stream_read_timeout_s`` bounds the wait for each streamed chunk; the default (no
        bound) suits batch work, which may wait long in the engine's queue behind higher
        priorities before its first token."""
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=64),
        )
        self._stream_timeout = httpx.Timeout(timeout_s, read=stream_read_timeout_s)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._client.request(method, self._url(path), **kwargs)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{method} {self.base_url}{path}: {exc!r}") from exc
        _raise_for_status(response, _error_message(response) if response.is_error else "")
        return response

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    async def metrics_text(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def pool(self) -> EnginePool:
        return parse_cache_config(await self.metrics_text())

    async def load(self) -> EngineLoad:
        return parse_engine_load(await self.metrics_text())

    async def health(self) -> bool:
        """Whether ``/health`` answers 200 (False rather than raising when it does not)."""
        try:
            await self._request("GET", "/health")
        except EngineError:
            return False
        return True

    async def models(self) -> list[ModelInfo]:
        payload = (await self._request("GET", "/v1/models")).json()
        return [
            ModelInfo(
                id=str(m["id"]),
                max_model_len=m.get("max_model_len"),
                root=m.get("root"),
            )
            for m in payload.get("data", ())
        ]

    async def _tokenize(self, body: Mapping[str, Any]) -> int:
        payload = (await self._request("POST", "/tokenize", json=body)).json()
        try:
            return int(payload["count"])
        except (KeyError, TypeError, ValueError):
            raise EngineFailed(200, f"/tokenize answered without a count: {payload!r}") from None

    async def tokenize_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        model: str,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        # vLLM's /tokenize tells a chat request from a prompt by the ``messages`` key, and
        # applies the chat template with the same defaults as /v1/chat/completions
        # (generation prompt on, no extra special tokens), so the counts agree.
        body: dict[str, Any] = {
            "model": model,
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
        }
        if chat_template_kwargs:
            body["chat_template_kwargs"] = dict(chat_template_kwargs)
        if tools:
            # Tool definitions are rendered into the prompt by the chat template.
            body["tools"] = list(tools)
        return await self._tokenize(body)

    async def tokenize_prompt(self, prompt: str, model: str) -> int:
        # add_special_tokens defaults to True, as /v1/completions tokenizes a prompt.
        return await self._tokenize({"model": model, "prompt": prompt})

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        return await self._tokenize({**body, "model": model})

    def stream_completion(
        self,
        endpoint: Endpoint | str,
        body: Mapping[str, Any],
        *,
        priority: int,
        request_id: str,
        stream_interval: int = 1,
    ) -> CompletionStream:
        path = Endpoint(endpoint).value
        payload = dict(body)
        payload.update(stream=True, priority=priority, request_id=request_id)
        if stream_interval > 1:
            payload["stream_interval"] = stream_interval
        # Running usage in every chunk tells the worker how many tokens a preempted request
        # had generated, which bounds its resumption.
        options = dict(payload.get("stream_options") or {})
        options.update(include_usage=True, continuous_usage_stats=True)
        payload["stream_options"] = options
        return CompletionStream(self._stream(path, payload, request_id))

    async def _stream(
        self, path: str, payload: Mapping[str, Any], request_id: str
    ) -> AsyncIterator[StreamChunk]:
        request = self._client.build_request(
            "POST",
            self._url(path),
            json=payload,
            headers={"X-Request-Id": request_id, "Accept": "text/event-stream"},
            timeout=self._stream_timeout,
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"POST {self.base_url}{path}: {exc!r}") from exc
        # Closing the response on every way out (including CancelledError thrown in at an
        # await, and GeneratorExit from aclose) drops the connection, which vLLM treats as an
        # abort of this request.
        try:
            if response.is_error:
                await response.aread()
                _raise_for_status(response, _error_message(response))
            try:
                async for line in sse_lines(response):
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    try:
                        event = json.loads(data)
                    except ValueError:
                        bad = data[:200]
                        raise EngineFailed(200, f"unparsable stream event: {bad!r}") from None
                    if "error" in event:
                        err = event["error"]
                        message = err.get("message", str(err)) if isinstance(err, dict) else err
                        code = err.get("code") if isinstance(err, dict) else None
                        status = code if isinstance(code, int) else 500
                        if 400 <= status < 500:
                            raise EngineRejected(
                                status, str(message), err if isinstance(err, dict) else None
                            )
                        raise EngineFailed(status, str(message))
                    yield _chunk(event)
            except httpx.TransportError as exc:
                where = f"{self.base_url}{path}"
                raise EngineUnavailable(f"stream from {where} broke: {exc!r}") from exc
        finally:
            await response.aclose()


async def read_engine_scheduler(
    url: str, *, timeout_s: float = 5.0, client: httpx.AsyncClient | None = None
) -> EngineScheduler | None:
    """The engine's step scheduler as its metrics at ``url`` describe it; None when nothing
    answers there, or what answers is not Backfill's scheduler."""
    try:
        if client is not None:
            response = await client.get(url, timeout=timeout_s)
        else:
            async with httpx.AsyncClient(timeout=timeout_s) as own:
                response = await own.get(url)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_scheduler_metrics(response.text)


async def count_prefill(engine: Engine, plan: PrefillPlan, model: str) -> PromptCount:
    """Carry out ``plan``: the engine counts each prompt given as text (at once), the
    prompts given as token ids are known."""
    counted = await asyncio.gather(*(engine.tokenize(body, model) for body in plan.tokenize))
    return PromptCount.of([*counted, *plan.known], plan.n)


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
