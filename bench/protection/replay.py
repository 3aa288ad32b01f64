"""Open-loop clients for the protection benchmark: an interactive trace replayed at its own
arrival times, and a batch flood kept at a fixed concurrency.

Interactive requests are streamed ``/v1/completions`` with prompts of random token ids (exact
lengths, no prefix-cache hits) and outputs forced to their length with ``ignore_eos``; the
same body goes straight to vLLM (with ``priority``) or to Backfill's gateway (which sets the
priority itself). Each request's times are taken on one monotonic clock: sent, first text,
every text chunk after it. A request the gateway refuses is counted, not timed.

The flood sends summarisation chat requests (``ignore_eos``, fixed ``max_tokens``) as fast
as ``concurrency`` allows until it is cancelled; cancelling closes its connections, which makes
vLLM abort what was in flight.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import secrets
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from backfill_analysis.simulate.trace import TraceRequest
from devkit.demo_job import DOCS, PROMPT

# Token ids inside the tiny model's vocabulary (1,024) and SmolLM2's (49,152), clear of the
# special tokens at the bottom of both; 980 choices per position keep random prompts apart.
TOKEN_ID_RANGE = (20, 1_000)


@dataclass
class InteractiveResult:
    """One replayed interactive request as the client saw it (seconds, monotonic clock)."""

    index: int
    prompt_tokens: int
    max_tokens: int
    scheduled: float
    sent: float
    status: int = 0
    first: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.first is not None and self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]


@dataclass(frozen=True)
class Target:
    """Where interactive requests go: straight to an engine or through the gateway."""

    url: str
    """Base URL; requests go to ``{url}/v1/completions``."""
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    priority: int | None = 0
    """Sent in the body when set (the gateway chooses its own, so it gets None)."""


def interactive_body(request: TraceRequest, target: Target, rng: random.Random) -> dict[str, Any]:
    lo, hi = TOKEN_ID_RANGE
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": [rng.randrange(lo, hi) for _ in range(request.prompt_tokens)],
        "max_tokens": request.output_tokens,
        "min_tokens": request.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if target.priority is not None:
        body["priority"] = target.priority
    return body


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The ``data:`` payloads of a server-sent event stream.

    Split on newlines only: httpx's ``aiter_lines`` also splits on U+2028, U+0085 and the
    like, which JSON leaves unescaped inside strings, so generated text cut events in two.
    """
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            if line.startswith("data:"):
                yield line[5:].strip()
    if buffer.startswith("data:"):
        yield buffer[5:].strip()


async def _one(
    client: httpx.AsyncClient,
    target: Target,
    index: int,
    request: TraceRequest,
    body: dict[str, Any],
    start: float,
) -> InteractiveResult:
    scheduled = start + request.arrival_s
    delay = scheduled - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    result = InteractiveResult(
        index, request.prompt_tokens, request.output_tokens, scheduled, time.monotonic()
    )
    try:
        async with client.stream(
            "POST", f"{target.url}/v1/completions", json=body, headers=dict(target.headers)
        ) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            async for data in sse_data(response):
                if data == "[DONE]":
                    break
                now = time.monotonic()
                try:
                    event = json.loads(data)
                except ValueError:
                    result.error = f"unparsable stream event: {data[:200]!r}"
                    break
                if "error" in event:
                    # vLLM reports errors found after the stream opened as an event, under 200.
                    result.error = json.dumps(event["error"])[:300]
                    break
                usage = event.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                if any(c.get("text") for c in event.get("choices") or ()):
                    if result.first is None:
                        result.first = now
                    result.chunk_times.append(now)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def replay(
    requests: Sequence[TraceRequest], target: Target, seed: int | None = None
) -> list[InteractiveResult]:
    """Send every request at its arrival time (open loop: a slow answer delays nothing)."""
    rng = random.Random(time.time_ns() if seed is None else seed)
    # Bodies are built before the clock starts: a 1,500-id prompt takes ~1 ms of Python.
    bodies = [interactive_body(r, target, rng) for r in requests]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        start = time.monotonic() + 0.2
        tasks = [
            _one(client, target, i, r, body, start)
            for i, (r, body) in enumerate(zip(requests, bodies, strict=True))
        ]
        return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------------------------------------
# The batch flood


@functools.cache
def _corpus() -> str:
    return "\n\n".join(p.read_text().strip() for p in sorted(Path(DOCS).glob("*.txt")))


def summarisation_body(
    model: str, index: int, prompt_chars: int, max_tokens: int, tag: str
) -> dict[str, Any]:
    """A chat body summarising a slice of the demo documents; the prompt starts with ``tag``
    and ``index`` so no two requests share a prefix-cache block."""
    corpus = _corpus()
    start = (index * 7919) % max(1, len(corpus) - prompt_chars)
    text = corpus[start : start + prompt_chars]
    return {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [
            {"role": "user", "content": f"[{tag}-{index:06d}] " + PROMPT.format(text=text)}
        ],
    }


@dataclass
class FloodStats:
    sent: int = 0
    completed: int = 0
    output_tokens: int = 0
    errors: int = 0


async def flood(
    url: str,
    model: str,
    *,
    concurrency: int,
    priority: int,
    prompt_chars: int,
    max_tokens: int,
    stats: FloodStats,
) -> None:
    """Keep ``concurrency`` batch requests in flight until cancelled."""
    tag = secrets.token_hex(4)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    counter = 0

    async def loop(client: httpx.AsyncClient) -> None:
        nonlocal counter
        while True:
            counter += 1
            body = summarisation_body(model, counter, prompt_chars, max_tokens, tag)
            body["priority"] = priority
            stats.sent += 1
            try:
                response = await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                stats.errors += 1
                await asyncio.sleep(0.5)
                continue
            if response.status_code != 200:
                stats.errors += 1
                await asyncio.sleep(0.5)
                continue
            stats.completed += 1
            stats.output_tokens += int(response.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(600.0), limits=limits
    ) as client:
        await asyncio.gather(*(loop(client) for _ in range(concurrency)))
