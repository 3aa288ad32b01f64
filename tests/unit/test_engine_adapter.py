"""The worker's HTTP engine adapter without an engine: how it maps engine answers to chunks and
typed errors, and how a preempted request is resumed from its partial output."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from backfill.engine.http import HttpEngine, sse_lines
from backfill.engine.protocol import (
    Endpoint,
    Engine,
    EngineFailed,
    EngineRejected,
    EngineUnavailable,
    StreamChunk,
)
from backfill.errors import BackfillError
from worker.engine import ResumeUnsupported, resume_request

Handler = Callable[[httpx.Request], httpx.Response]


def _engine(handler: Handler) -> HttpEngine:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return HttpEngine("http://engine.test", client=client)


def _sse(*events: dict[str, Any] | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


async def _collect(
    engine: HttpEngine, endpoint: Endpoint, body: dict[str, Any]
) -> list[StreamChunk]:
    async with engine.stream_completion(endpoint, body, priority=7, request_id="r-1") as stream:
        return [chunk async for chunk in stream]


def test_http_engine_satisfies_the_engine_protocol() -> None:
    assert isinstance(HttpEngine("http://x"), Engine)


def test_stream_sends_priority_request_id_and_running_usage() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        seen["header"] = request.headers["x-request-id"]
        seen["path"] = request.url.path
        return httpx.Response(200, content=_sse("[DONE]"))

    asyncio.run(_collect(_engine(handler), Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 4}))
    assert seen["path"] == "/v1/completions"
    assert seen["header"] == "r-1"
    body = seen["body"]
    assert body["stream"] is True
    assert body["priority"] == 7
    assert body["request_id"] == "r-1"
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}


def test_a_stream_interval_is_asked_only_when_over_one() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, content=_sse("[DONE]"))

    async def both() -> None:
        engine = _engine(handler)
        for interval in (1, 16):
            async with engine.stream_completion(
                Endpoint.COMPLETIONS,
                {"prompt": "x", "max_tokens": 4},
                priority=10,
                request_id=f"r-{interval}",
                stream_interval=interval,
            ) as stream:
                _ = [c async for c in stream]

    asyncio.run(both())
    assert "stream_interval" not in bodies[0]
    assert bodies[1]["stream_interval"] == 16


def test_chat_stream_chunks_carry_deltas_finish_reason_and_usage() -> None:
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    events = (
        {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hel"}}], "usage": usage},
        {
            "id": "c",
            "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "length"}],
        },
        {"id": "c", "choices": [], "usage": usage},
        "[DONE]",
    )
    engine = _engine(lambda request: httpx.Response(200, content=_sse(*events)))
    chunks = asyncio.run(_collect(engine, Endpoint.CHAT_COMPLETIONS, {"messages": []}))
    assert "".join(c.text for c in chunks) == "Hello"
    assert [c.finish_reason for c in chunks] == [None, None, "length", None]
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("status", "error"),
    [(400, EngineRejected), (404, EngineRejected), (500, EngineFailed), (503, EngineUnavailable)],
)
def test_engine_status_codes_become_typed_errors(status: int, error: type[Exception]) -> None:
    payload = {"error": {"message": "max_tokens too large", "code": status}}
    engine = _engine(lambda request: httpx.Response(status, json=payload))
    with pytest.raises(error) as caught:
        asyncio.run(_collect(engine, Endpoint.COMPLETIONS, {"prompt": "x"}))
    assert isinstance(caught.value, BackfillError)
    if isinstance(caught.value, EngineRejected | EngineFailed):
        assert caught.value.status == status
        assert caught.value.message == "max_tokens too large"
    with pytest.raises(error):
        asyncio.run(engine.tokenize_prompt("x", "m"))


def test_error_event_inside_a_stream_raises() -> None:
    events = ({"error": {"message": "engine dead", "code": 500}},)
    engine = _engine(lambda request: httpx.Response(200, content=_sse(*events)))
    with pytest.raises(EngineFailed, match="engine dead"):
        asyncio.run(_collect(engine, Endpoint.COMPLETIONS, {"prompt": "x"}))


def test_connection_refused_is_unavailable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    engine = _engine(refuse)
    with pytest.raises(EngineUnavailable):
        asyncio.run(_collect(engine, Endpoint.COMPLETIONS, {"prompt": "x"}))
    with pytest.raises(EngineUnavailable):
        asyncio.run(engine.load())
    assert asyncio.run(engine.health()) is False


def test_tokenize_sends_messages_for_chat_and_prompt_for_text() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"count": 11, "tokens": [], "max_model_len": 64})

    engine = _engine(handler)
    messages = [{"role": "user", "content": "hi"}]
    assert asyncio.run(engine.tokenize_chat(messages, "m")) == 11
    assert asyncio.run(engine.tokenize_prompt("hi", "m")) == 11
    assert bodies[0]["messages"] == messages
    assert bodies[0]["add_generation_prompt"] is True
    assert bodies[1] == {"model": "m", "prompt": "hi"}


# --- resume ----------------------------------------------------------------------------------


def test_resumed_completion_appends_partial_text_and_spends_the_rest_of_the_budget() -> None:
    body = {"model": "m", "prompt": "Once", "max_tokens": 64, "temperature": 0}
    resumed = resume_request(Endpoint.COMPLETIONS, body, " upon a", generated_tokens=2)
    assert resumed["prompt"] == "Once upon a"
    assert resumed["max_tokens"] == 62
    assert body["prompt"] == "Once"
    assert body["max_tokens"] == 64


def test_resumed_completion_without_max_tokens_uses_the_default_budget() -> None:
    resumed = resume_request("/v1/completions", {"prompt": ["a"]}, "b", generated_tokens=10)
    assert resumed["prompt"] == "ab"
    assert resumed["max_tokens"] == 6


def test_resumed_chat_continues_a_final_assistant_message() -> None:
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "max_completion_tokens": 10}
    resumed = resume_request(Endpoint.CHAT_COMPLETIONS, body, "Hel", generated_tokens=3)
    assert resumed["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert resumed["continue_final_message"] is True
    assert resumed["add_generation_prompt"] is False
    assert resumed["max_completion_tokens"] == 7
    assert len(messages) == 1


def test_a_resume_reads_lax_numbers_as_the_engine_does() -> None:
    # Stored before validation normalised numbers: int("3.0") crashed the resume and left
    # the item running for good.
    body = {"prompt": "x", "max_tokens": "8.0", "min_tokens": "3.0"}
    resumed = resume_request(Endpoint.COMPLETIONS, body, "y", generated_tokens=2)
    assert (resumed["max_tokens"], resumed["min_tokens"]) == (6, 1)


@pytest.mark.parametrize(
    ("endpoint", "body", "generated"),
    [
        (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 5}, 5),
        (Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 5, "min_tokens": "3.5"}, 1),
        (Endpoint.COMPLETIONS, {"prompt": "x", "n": 2, "max_tokens": 5}, 1),
        (Endpoint.COMPLETIONS, {"prompt": "x", "echo": True, "max_tokens": 5}, 1),
        (Endpoint.COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 5}, 1),
        (Endpoint.CHAT_COMPLETIONS, {"messages": [], "max_tokens": 5}, 1),
    ],
)
def test_requests_that_cannot_be_resumed_say_so(
    endpoint: Endpoint, body: dict[str, Any], generated: int
) -> None:
    with pytest.raises(ResumeUnsupported):
        resume_request(endpoint, body, "partial", generated_tokens=generated)


def test_sse_lines_split_on_newline_only_not_on_unicode_line_separators() -> None:
    text = 'data: {"t": "a\u2028b\u0085c"}\r\n\ndata: [DONE]\n'
    raw = text.encode()

    class Chunks(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for cut in (raw[:7], raw[7:20], raw[20:]):
                yield cut

    async def collect() -> list[str]:
        response = httpx.Response(200, stream=Chunks())
        return [line async for line in sse_lines(response)]

    lines = asyncio.run(collect())
    assert lines == ['data: {"t": "a\u2028b\u0085c"}', "", "data: [DONE]"]


class _HeldBody(httpx.AsyncByteStream):
    """A response body that sends ``first`` and then holds, recording when it is closed
    (what the engine sees as the client going away: vLLM aborts the request)."""

    def __init__(self, first: bytes) -> None:
        self.first = first
        self.closed = False

    async def __aiter__(self) -> Any:
        yield self.first
        await asyncio.Event().wait()

    async def aclose(self) -> None:
        self.closed = True


def test_leaving_a_stream_early_closes_its_response_for_completions_and_responses() -> None:
    bodies: list[_HeldBody] = []

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        event = (
            {"type": "response.output_text.delta", "delta": "a"}
            if path == "/v1/responses"
            else {"id": "c", "choices": [{"index": 0, "text": "a"}]}
        )
        bodies.append(_HeldBody(_sse(event)))
        return httpx.Response(200, stream=bodies[-1])

    engine = _engine(handler)

    async def first_of_each() -> None:
        async with engine.stream_completion(
            Endpoint.COMPLETIONS, {"prompt": "x"}, priority=1, request_id="r-1"
        ) as stream:
            chunk = await stream.__anext__()
            assert chunk.text == "a"
        # At once, not when the abandoned generator is collected: the engine keeps the
        # request's KV blocks until then.
        assert bodies[0].closed
        async with engine.stream_responses({"input": "x"}, priority=1, request_id="r-2") as events:
            assert (await events.__anext__())["delta"] == "a"
        assert bodies[1].closed

    asyncio.run(first_of_each())


def test_a_responses_stream_sends_priority_request_id_and_yields_typed_events() -> None:
    seen: dict[str, Any] = {}
    events = (
        {"type": "response.created", "response": {"id": "r-1"}},
        {"type": "response.output_text.delta", "delta": "hi"},
        {"type": "response.completed", "response": {"id": "r-1", "output": []}},
    )

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        seen["path"] = request.url.path
        return httpx.Response(200, content=_sse(*events))

    async def collect() -> list[dict[str, Any]]:
        engine = _engine(handler)
        async with engine.stream_responses(
            {"input": "x", "store": False}, priority=7, request_id="r-1"
        ) as stream:
            return [event async for event in stream]

    assert asyncio.run(collect()) == list(events)
    assert seen["path"] == "/v1/responses"
    assert seen["body"] == {
        "input": "x",
        "store": False,
        "stream": True,
        "priority": 7,
        "request_id": "r-1",
    }


def test_tokenize_ids_answers_the_engines_token_ids_and_refuses_an_answer_without_them() -> None:
    seen: dict[str, Any] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, json={"count": 3, "max_model_len": 64, "tokens": [5, 6, 7]})

    body = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
    assert asyncio.run(_engine(handler).tokenize_ids(body, "m")) == [5, 6, 7]
    assert seen["body"] == {**body, "model": "m"}

    def no_ids(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"count": 3})

    with pytest.raises(EngineFailed, match="token ids"):
        asyncio.run(_engine(no_ids).tokenize_ids(body, "m"))
