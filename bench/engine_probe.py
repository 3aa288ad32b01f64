"""Timed requests against a real vLLM server, for calibrating the simulator's cost model.

Prompts are random token ids (exact lengths, no prefix-cache hits); outputs are forced to
their length with ``ignore_eos``. Each workload isolates one term of the cost model: a prompt
alone (prefill), many short prompts decoding together (decode), long prompts decoding
(attention over context); a held-back closed-loop workload checks the fit.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from backfill_analysis.simulate.costmodel import Observation, StepWork, prefill_attention

# Token ids inside both SmolLM2's (49,152) and the tiny model's (1,024) vocabularies, clear
# of their special tokens; vLLM refuses an id outside the vocabulary (400).
_TOKEN_LO, _TOKEN_HI = 300, 1_000


@dataclass(frozen=True)
class Timing:
    """One streamed request, seen by the client (seconds on a monotonic clock)."""

    prompt_tokens: int
    output_tokens: int
    sent: float
    first: float
    last: float
    token_times: tuple[float, ...] = ()
    """When each streamed chunk arrived (a chunk may carry more than one token)."""

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def mean_itl(self) -> float:
        return (self.last - self.first) / max(1, self.output_tokens - 1)


class Probe:
    """A client for one server and model; every prompt it sends is fresh random tokens."""

    def __init__(self, url: str, model: str, seed: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.rng = random.Random(time.time_ns() if seed is None else seed)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=512),
        )

    async def max_model_len(self) -> int:
        """The served model's context, as the engine reports it (``/v1/models``)."""
        models = (await self.client.get(f"{self.url}/v1/models")).json()["data"]
        return int(next(m for m in models if m["id"] == self.model)["max_model_len"])

    async def close(self) -> None:
        await self.client.aclose()

    def _prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(_TOKEN_LO, _TOKEN_HI) for _ in range(tokens)]

    async def request(self, prompt_tokens: int, output_tokens: int, priority: int = 0) -> Timing:
        body = {
            "model": self.model,
            "prompt": self._prompt(prompt_tokens),
            "max_tokens": output_tokens,
            "min_tokens": output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": priority,
        }
        sent = time.monotonic()
        first = last = 0.0
        produced = 0
        times: list[float] = []
        async with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.monotonic()
                if chunk.get("choices"):
                    first = first or now
                    last = now
                    times.append(now)
                usage = chunk.get("usage")
                if usage:
                    produced = int(usage["completion_tokens"])
        return Timing(prompt_tokens, produced, sent, first, last, tuple(times))

    async def closed_loop(
        self, shapes: Sequence[tuple[int, int]], concurrency: int
    ) -> tuple[list[Timing], float]:
        """Send ``shapes`` (prompt, output) in order, ``concurrency`` at a time; returns the
        timings and the makespan."""
        queue = list(reversed(shapes))
        timings: list[Timing] = []
        start = time.monotonic()

        async def client() -> None:
            while queue:
                prompt, out = queue.pop()
                timings.append(await self.request(prompt, out))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return timings, time.monotonic() - start


async def prefill_observations(
    probe: Probe, lengths: Sequence[int], repeats: int
) -> list[Observation]:
    """One prompt at a time, one output token: time to first token is one prefill step plus
    the request's own overhead."""
    out: list[Observation] = []
    for _ in range(repeats):
        for p in lengths:
            t = await probe.request(p, 1)
            work = StepWork(prefill_tokens=p, prefill_attention=prefill_attention(0, p))
            out.append(Observation(work, t.ttft, with_request_overhead=True))
    return out


DECODE_TRIES = 6
"""Runs of a decode case before it is left out for never decoding together."""


async def decode_observations(
    probe: Probe, cases: Sequence[tuple[int, int, int]]
) -> list[Observation]:
    """``(sequences, prompt, output)``: that many requests decode together. Only the window
    in which all of them decode counts (after the last first token, before the first last
    token), so no prefill step is mistaken for a decode step. A case whose requests never
    decoded together (on a loaded machine the last prefill can end after the first request
    has finished) is run again with twice the output, so the window it needs is wider, up to
    ``DECODE_TRIES`` times or the model's context, then left out (a CI run beside a busy
    machine left one of four cases out after three tries)."""
    context = await probe.max_model_len()
    out: list[Observation] = []
    for n, prompt, output in cases:
        gaps: list[float] = []
        tried = 0
        for attempt in range(DECODE_TRIES):
            tokens = min(output << attempt, context - prompt - 1)
            if tokens <= tried:
                break  # the context allows no wider window
            tried = tokens
            timings = await asyncio.gather(*(probe.request(prompt, tokens) for _ in range(n)))
            start = max(t.first for t in timings)
            end = min(t.last for t in timings)
            for t in timings:
                inside = [x for x in t.token_times if start <= x <= end]
                if len(inside) >= 2:
                    gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
            if gaps:
                break
        if not gaps:
            continue
        done = sum(sum(1 for x in t.token_times if x < start) for t in timings) / n
        work = StepWork(
            decode_tokens=n,
            decode_context=int(n * (prompt + done + (len(timings[0].token_times) - done) / 2)),
        )
        out.append(Observation(work, statistics.median(gaps)))
    return out


async def warm_up(probe: Probe) -> None:
    """The first requests after start pay one-off costs (allocations, caches)."""
    await asyncio.gather(*(probe.request(256, 8) for _ in range(4)))
    await probe.request(1024, 2)
