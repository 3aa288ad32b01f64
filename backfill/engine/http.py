"""The vLLM HTTP client: :class:`~backfill.engine.protocol.Engine` over vLLM's
OpenAI-compatible server, the same on GPU and CPU nodes; the worker and the gateway share it.

Two rules its callers rely on:

* The pool is **measured** from the engine's ``/metrics`` (``vllm:cache_config_info``),
  never computed.
* **Abort = close the stream.** vLLM aborts a request and frees its KV blocks when the client
  disconnects. :class:`~backfill.engine.protocol.CompletionStream` closes its HTTP response
  when the consuming task is cancelled, when the ``async with`` block exits, or on
  :meth:`~backfill.engine.protocol.CompletionStream.aclose`.

It speaks HTTP with ``httpx`` only: no vLLM code is imported.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import httpx

from backfill.engine.protocol import (
    AsyncClosing,
    ChoiceDelta,
    CompletionStream,
    Endpoint,
    EngineError,
    EngineFailed,
    EngineRejected,
    EngineUnavailable,
    EventStream,
    ModelInfo,
    StreamChunk,
    Usage,
)
from backfill.engine_metrics import EngineLoad, EnginePool, parse_cache_config, parse_engine_load
from backfill.engine_scheduler import EngineScheduler, parse_scheduler_metrics

__all__ = ["HttpEngine", "read_engine_scheduler", "sse_lines"]


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


def sse_lines_blocking(response: httpx.Response) -> Iterator[str]:
    """:func:`sse_lines` for a blocking client's response."""
    pending = ""
    for text in response.iter_text():
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


def _error_object(response: httpx.Response) -> dict[str, Any] | None:
    """The engine's error object of a refusal (``{"error": {...}}``), if it sent one."""
    try:
        payload = response.json()
    except ValueError:
        return None
    inner = payload.get("error") if isinstance(payload, dict) else None
    return inner if isinstance(inner, dict) else None


def _raise_for_status(response: httpx.Response, message: str) -> None:
    status = response.status_code
    if status < 400:
        return
    if status in {502, 503, 504}:
        raise EngineUnavailable(f"engine answered {status}: {message}")
    if status < 500:
        raise EngineRejected(status, message, _error_object(response))
    raise EngineFailed(status, message)


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


KEEPALIVE_EXPIRY_S = 2.0
"""How long an idle pooled connection to an engine is reused: well below the engine's own
keep-alive (vLLM's ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s, which is also httpx's default
expiry). With both at 5 s a request sent on a connection idle for just under 5 s crosses the
server's close and fails (a read error on a request the engine never saw); on a loaded
machine, where neither side runs on time, that window is wide."""


def engine_limits(max_connections: int, max_keepalive_connections: int) -> httpx.Limits:
    """Connection limits for a client of engines (:data:`KEEPALIVE_EXPIRY_S`)."""
    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=KEEPALIVE_EXPIRY_S,
    )


class HttpEngine(AsyncClosing):
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
            limits=engine_limits(max_connections, 64),
        )
        self._stream_timeout = httpx.Timeout(timeout_s, read=stream_read_timeout_s)

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

    async def endpoints(self) -> frozenset[Endpoint]:
        """The batch endpoints this engine serves. vLLM mounts only the routes its model's
        runner supports (a pooling model: no completions; a generating one: no embeddings), so
        an empty body is enough to ask: a route that is not mounted answers FastAPI's 404
        ``Not Found`` before any model work; one that is refuses the body (400/422)."""
        served: set[Endpoint] = set()
        for endpoint in Endpoint:
            try:
                response = await self._client.post(self._url(endpoint.value), json={})
            except httpx.TransportError as exc:
                raise EngineUnavailable(f"POST {self.base_url}{endpoint}: {exc!r}") from exc
            if response.status_code >= 500:
                _raise_for_status(response, _error_message(response))
            if not _route_missing(response):
                served.add(endpoint)
        return frozenset(served)

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

    async def tokenize_ids(self, body: Mapping[str, Any], model: str) -> list[int]:
        # vLLM's /tokenize answers the ids with the count (``tokens``): the prompt exactly as
        # the engine renders and caches it, which is what shared prefixes are found from.
        payload = (await self._request("POST", "/tokenize", json={**body, "model": model})).json()
        tokens = payload.get("tokens") if isinstance(payload, dict) else None
        if type(tokens) is not list or not all(type(t) is int for t in tokens):
            raise EngineFailed(200, f"/tokenize answered without token ids: {payload!r}")
        return tokens

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

    def stream_responses(
        self, body: Mapping[str, Any], *, priority: int, request_id: str
    ) -> EventStream:
        # vLLM takes the request id from the body here (the response's id is that id), and
        # sends no per-event usage: the final event carries the response with its usage.
        payload = {**body, "stream": True, "priority": priority, "request_id": request_id}
        return EventStream(self._events(Endpoint.RESPONSES.value, payload, request_id))

    async def embed(
        self, body: Mapping[str, Any], *, priority: int, request_id: str
    ) -> dict[str, Any]:
        payload = {**body, "priority": priority, "request_id": request_id}
        # Waited for as long as a stream's first token: batch waits behind higher priorities.
        response = await self._request(
            "POST",
            Endpoint.EMBEDDINGS.value,
            json=payload,
            headers={"X-Request-Id": request_id},
            timeout=self._stream_timeout,
        )
        try:
            answer = response.json()
        except ValueError:
            raise EngineFailed(
                200, f"unparsable embeddings answer: {response.text[:200]!r}"
            ) from None
        if not isinstance(answer, dict):
            raise EngineFailed(200, f"the embeddings answer is not an object: {answer!r:.200}")
        return answer

    async def _stream(
        self, path: str, payload: Mapping[str, Any], request_id: str
    ) -> AsyncIterator[StreamChunk]:
        # aclosing: closing this generator closes the events' one at once, and with it the
        # response (an abandoned async generator closes only when collected).
        async with contextlib.aclosing(self._events(path, payload, request_id)) as events:
            async for event in events:
                yield _chunk(event)

    async def _events(
        self, path: str, payload: Mapping[str, Any], request_id: str
    ) -> AsyncGenerator[dict[str, Any], None]:
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
                    if not isinstance(event, dict):
                        raise EngineFailed(200, f"stream event is not an object: {data[:200]!r}")
                    yield event
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


def _route_missing(response: httpx.Response) -> bool:
    """FastAPI's answer for a path no route is mounted at (not an engine's refusal)."""
    if response.status_code != 404:
        return False
    try:
        return bool(response.json() == {"detail": "Not Found"})
    except ValueError:
        return False
