"""The benchmarks' and devkit's stream probes read server-sent events split on ``\\n`` only:
httpx's ``iter_lines`` also splits on U+2028, U+0085 and friends, which JSON leaves unescaped
inside strings, so a generated text holding one cut an event in two (and its JSON failed)."""

from __future__ import annotations

from typing import Any

import httpx

from backfill.engine.http import sse_lines_blocking
from bench.gateway.compare import stream

EVENTS = (
    'data: {"choices": [{"text": "a\u2028b\u0085c"}]}\r\n\n'
    'data: {"choices": [{"text": "d"}]}\n\ndata: [DONE]\n'
).encode()


class _Chunks(httpx.SyncByteStream):
    def __iter__(self) -> Any:
        yield from (EVENTS[:7], EVENTS[7:30], EVENTS[30:])


def test_blocking_sse_lines_split_on_newline_only() -> None:
    lines = list(sse_lines_blocking(httpx.Response(200, stream=_Chunks())))
    assert lines == [
        'data: {"choices": [{"text": "a\u2028b\u0085c"}]}',
        "",
        'data: {"choices": [{"text": "d"}]}',
        "",
        "data: [DONE]",
    ]


def test_the_gateway_benchmarks_probe_reads_text_holding_a_line_separator() -> None:
    def engine(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_Chunks(), headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(engine)) as client:
        timing = stream(client, "http://engine/v1/completions", {}, {})
    assert timing.ttft_s >= 0
