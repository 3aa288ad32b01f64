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
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from backfill.engine.http import engine_limits, sse_lines
from backfill_analysis.simulate.costmodel import Observation, StepWork, prefill_attention
from devkit.enginespeed import probe_body

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


_COUNTERS = (
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_count",
    "vllm:iteration_tokens_total_count",
    "vllm:generation_tokens_total",
)


@dataclass(frozen=True)
class EngineCounters:
    """What vLLM counts from its engine core's own timestamps and steps, which a loaded API
    server streaming seconds behind the core does not blur."""

    token_gaps_s: float
    """Time between a request's tokens, summed (``vllm:inter_token_latency_seconds``)."""
    token_gaps: float
    steps: float
    """Engine steps that produced output (``vllm:iteration_tokens_total``'s count)."""
    generated: float
    """Tokens generated (``vllm:generation_tokens_total``)."""

    def since(self, before: EngineCounters) -> EngineCounters:
        return EngineCounters(
            self.token_gaps_s - before.token_gaps_s,
            self.token_gaps - before.token_gaps,
            self.steps - before.steps,
            self.generated - before.generated,
        )


class Probe:
    """A client for one server and model; every prompt it sends is fresh random tokens."""

    def __init__(self, url: str, model: str, seed: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.rng = random.Random(time.time_ns() if seed is None else seed)
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(600.0),
            # Idle connections given up before vLLM's keep-alive closes them (a request sent as
            # it closes one failed a CI run's calibration test with a read error).
            limits=engine_limits(512, 512),
        )

    async def max_model_len(self) -> int:
        """The served model's context, as the engine reports it (``/v1/models``)."""
        models = (await self.client.get(f"{self.url}/v1/models")).json()["data"]
        return int(next(m for m in models if m["id"] == self.model)["max_model_len"])

    async def close(self) -> None:
        await self.client.aclose()

    async def counters(self) -> EngineCounters:
        """vLLM's own counters so far, from its ``/metrics``."""
        text = (await self.client.get(f"{self.url}/metrics")).text
        found = dict.fromkeys(_COUNTERS, 0.0)
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in found:
                found[name] += float(line.rsplit(" ", 1)[1])
        return EngineCounters(*(found[name] for name in _COUNTERS))

    def _prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(_TOKEN_LO, _TOKEN_HI) for _ in range(tokens)]

    async def request(self, prompt_tokens: int, output_tokens: int, priority: int = 0) -> Timing:
        body = {
            **probe_body(self.model, self._prompt(prompt_tokens), output_tokens),
            "priority": priority,
        }
        sent = time.monotonic()
        first = last = 0.0
        produced = 0
        times: list[float] = []
        async with self.client.stream("POST", f"{self.url}/v1/completions", json=body) as resp:
            resp.raise_for_status()
            async for line in sse_lines(resp):
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
TOGETHER = 0.8
"""The share of a case's requests that must decode in its steps on average."""


async def decode_observations(
    probe: Probe, cases: Sequence[tuple[int, int, int]]
) -> list[Observation]:
    """``(sequences, prompt, output)``: that many requests decode together; a case's step time
    is the engine's mean time between tokens over the case, from its core's own timestamps (a
    client's arrival times on a loaded machine come in bursts, microseconds apart). The few
    steps that also carry the case's prefills weigh little against its output. A case whose
    requests did not decode together (fewer than ``TOGETHER`` of them per step on average, as
    the engine counts its steps: on a loaded machine the API server can pass the last request
    in after the first has finished) is run again with twice the output, up to
    ``DECODE_TRIES`` times or the model's context, then left out."""
    context = await probe.max_model_len()
    out: list[Observation] = []
    for n, prompt, output in cases:
        seen: EngineCounters | None = None
        tried = 0
        for attempt in range(DECODE_TRIES):
            tokens = min(output << attempt, context - prompt - 1)
            if tokens <= tried:
                break  # the context allows no wider window
            tried = tokens
            before = await probe.counters()
            await asyncio.gather(*(probe.request(prompt, tokens) for _ in range(n)))
            run = (await probe.counters()).since(before)
            if run.token_gaps > 0 and run.steps > 0 and run.generated / run.steps >= TOGETHER * n:
                seen = run
                break
        if seen is None:
            continue
        # The mean context over the decode: the prompt and half the output.
        work = StepWork(decode_tokens=n, decode_context=int(n * (prompt + tried / 2)))
        out.append(Observation(work, seen.token_gaps_s / seen.token_gaps))
    return out


async def warm_up(probe: Probe) -> None:
    """The first requests after start pay one-off costs (allocations, caches)."""
    await asyncio.gather(*(probe.request(256, 8) for _ in range(4)))
    await probe.request(1024, 2)
