"""How fast a running engine is on this machine, measured, so that tests and benchmarks size
their workloads and timeouts from it rather than from a figure taken on another machine.

Machines of the same kind differ several-fold (an AVX2 CPU emulates bfloat16; a shared one is
loaded): the project's engine notes measured SmolLM2's prefill at ~70 tok/s on one and ~1,100 on
another. :func:`measure_speed` takes a few seconds: one prompt at a time for prefill, one
stream alone for decode, the median of a few tries of each.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from backfill.engine.http import sse_lines_blocking

# Varied English, tokenized once by the engine: its tokens are the alphabet of the probe
# prompts, valid ids for any model's vocabulary and never special tokens.
_SAMPLE_TEXT = (
    "A quiet river winds past old mills, where grey herons fish among the reeds and the "
    "miller's children count barges loaded with timber, wool, salt and bright copper pans. "
    "Seventeen lanterns swing above the market; merchants argue over prices of figs, "
    "cinnamon, leather boots and wax candles while a juggler drops his ninth orange."
)


@dataclass(frozen=True)
class EngineSpeed:
    """Prompt tokens per second of one prefill alone, and tokens per second of one stream
    decoding alone (a batch decodes more in all, each sequence no faster)."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    def seconds_for(self, prompt_tokens: float, output_tokens: float) -> float:
        """One request alone, start to end: an upper bound for it on an idle engine."""
        return prompt_tokens / self.prefill_tokens_per_s + output_tokens / self.decode_tokens_per_s

    def seconds_for_batch(
        self, requests: int, prompt_tokens: int, output_tokens: int, at_once: int
    ) -> float:
        """``requests`` alike, ``at_once`` at a time, each wave taking as long as one request
        alone: about right for a model as small as the tests' tiny one, whose steps cost
        about the same for one sequence or sixteen; a bigger model's batched steps are longer."""
        waves = -(-requests // max(1, at_once))
        return waves * self.seconds_for(prompt_tokens, output_tokens)

    def __str__(self) -> str:
        return (
            f"prefill {self.prefill_tokens_per_s:,.0f} tok/s, "
            f"decode {self.decode_tokens_per_s:,.1f} tok/s (one stream)"
        )


@dataclass(frozen=True)
class _Stream:
    sent: float
    first: float
    last: float
    output_tokens: int


def _alphabet(client: httpx.Client, model: str) -> tuple[list[int], int]:
    reply = client.post(
        "/tokenize", json={"model": model, "prompt": _SAMPLE_TEXT, "add_special_tokens": False}
    )
    reply.raise_for_status()
    body = reply.json()
    return sorted(set(body["tokens"])), int(body.get("max_model_len") or 2048)


def probe_body(model: str, prompt: list[int], output_tokens: int) -> dict[str, Any]:
    """A streamed ``/v1/completions`` body of the token ids ``prompt`` that generates exactly
    ``output_tokens`` tokens (greedy, EOS ignored), its usage in the last chunk: a timing
    probe."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _stream(client: httpx.Client, model: str, prompt: list[int], output_tokens: int) -> _Stream:
    body = probe_body(model, prompt, output_tokens)
    sent = time.monotonic()
    first = last = 0.0
    produced = 0
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in sse_lines_blocking(response):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                first = first or now
                last = now
            if chunk.get("usage"):
                produced = int(chunk["usage"]["completion_tokens"])
    return _Stream(sent, first, last, produced)


def measure_speed(
    url: str,
    model: str,
    *,
    prompt_tokens: int = 256,
    output_tokens: int = 24,
    tries: int = 3,
    timeout_s: float = 600.0,
) -> EngineSpeed:
    """Measure the engine at ``url`` serving ``model``; every prompt is fresh (no prefix-cache
    hit). Prefill is timed to the first token (so it includes the request's own overhead and
    errs slow), decode between the first and last token of a stream."""
    rng = random.Random(time.time_ns())
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as client:
        alphabet, max_model_len = _alphabet(client, model)
        prompt_tokens = max(1, min(prompt_tokens, max_model_len - output_tokens - 1))

        def prompt(n: int) -> list[int]:
            return [rng.choice(alphabet) for _ in range(n)]

        _stream(client, model, prompt(16), 4)  # the first request pays one-off costs
        prefill: list[float] = []
        decode: list[float] = []
        for _ in range(tries):
            alone = _stream(client, model, prompt(prompt_tokens), 1)
            prefill.append(prompt_tokens / max(alone.first - alone.sent, 1e-6))
            streamed = _stream(client, model, prompt(8), output_tokens)
            decode.append(
                max(1, streamed.output_tokens - 1) / max(streamed.last - streamed.first, 1e-6)
            )
    return EngineSpeed(statistics.median(prefill), statistics.median(decode))
