"""The dispatcher counts a claim's prompts with a bounded number of engine requests at once.

vLLM's ``/tokenize`` (and the httpx client in front of it) counts prompts several times faster
at 8 concurrent requests than at 64 on a small node, and a claimed batch starts only when all
of its prompts are counted, so the bound is a throughput matter (``bench.throughput``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, cast

from backfill.engine.protocol import Engine
from backfill.ledger import AsyncLedger
from backfill.store import ClaimedItem, Repository
from tests.unit.dispatch_builders import claimed
from worker.dispatch import DispatchConfig, NodeDispatcher


class CountingEngine:
    """Answers prompt counts after a short wait and records how many were asked at once."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.most_at_once = 0
        self.calls = 0

    async def _count(self, tokens: int) -> int:
        self.calls += 1
        self.in_flight += 1
        self.most_at_once = max(self.most_at_once, self.in_flight)
        try:
            await asyncio.sleep(0.01)
        finally:
            self.in_flight -= 1
        return tokens

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        if "messages" in body:
            return await self._count(len(str(body["messages"][0]["content"])))
        return await self._count(len(body["prompt"]))


def _claimed(n: int, *, prompt_tokens: int | None = None) -> list[ClaimedItem]:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}
    return [
        claimed(
            i,
            body=json.dumps(body),
            deadline=datetime.now(UTC) + timedelta(hours=1),
            prompt_tokens=prompt_tokens,
            max_output_tokens=8,
            endpoint="/v1/chat/completions",
        )
        for i in range(n)
    ]


def _dispatcher(engine: CountingEngine, **config: Any) -> NodeDispatcher:
    # Counting and checking a claim touches neither Postgres nor the ledger when every item
    # is valid and on time.
    return NodeDispatcher(
        DispatchConfig(node="n", **config),
        cast(Engine, engine),
        cast(Repository, None),
        cast(AsyncLedger, None),
        model="m",
        block_size=16,
        max_sequence_tokens=4096,
    )


def test_a_claims_prompts_are_counted_at_most_tokenize_concurrency_at_once() -> None:
    engine = CountingEngine()
    dispatcher = _dispatcher(engine, tokenize_concurrency=8)

    ready, refused = asyncio.run(dispatcher.checker.check(_claimed(64)))

    assert not refused

    assert len(ready) == 64
    assert [p.count.total for p in ready] == [5] * 64
    assert engine.calls == 64
    assert engine.most_at_once == 8


def test_prompts_counted_before_are_not_counted_again() -> None:
    engine = CountingEngine()
    dispatcher = _dispatcher(engine)

    ready, refused = asyncio.run(dispatcher.checker.check(_claimed(4, prompt_tokens=7)))

    assert not refused

    assert [p.count.total for p in ready] == [7] * 4
    assert engine.calls == 0


class RenderingEngine:
    """Counts one token per character of the whole /tokenize body it is sent (so every field
    that renders into the prompt adds to the count), and records the bodies."""

    def __init__(self) -> None:
        self.bodies: list[Mapping[str, Any]] = []

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        self.bodies.append(body)
        return len(json.dumps({k: v for k, v in body.items() if k != "model"}))


def _item(body: dict[str, Any], endpoint: str, max_tokens: int = 8) -> ClaimedItem:
    return ClaimedItem(
        id=1,
        job_id="job",
        attempt=1,
        custom_id="r",
        body=json.dumps(body),
        deadline=datetime.now(UTC) + timedelta(hours=1),
        prompt_tokens=None,
        max_output_tokens=max_tokens,
        reservation_tokens=None,
        preemptions=0,
        partial_output=None,
        partial_tokens=0,
        endpoint=endpoint,
        deadline_left_s=3600.0,
    )


def test_a_line_of_several_prompts_reserves_every_sequence() -> None:
    engine = RenderingEngine()
    dispatcher = _dispatcher(cast(CountingEngine, engine))
    prompts = ["x" * 10, "y" * 100, "z"]
    body = {"model": "m", "prompt": prompts, "max_tokens": 50}

    (ready,), refused = asyncio.run(dispatcher.checker.check([_item(body, "/v1/completions", 50)]))
    assert not refused

    counts = [len(json.dumps({"prompt": p})) for p in prompts]
    assert ready.count.sequences == 3
    assert ready.count.longest == max(counts)
    # Each sequence holds its own prompt and output: three of the longest, block-rounded.
    per_sequence = -(-(max(counts) + 50) // 16) * 16
    assert ready.reservation(16) == 3 * per_sequence
    assert ready.reservation(16) >= sum(c + 50 for c in counts)


def test_a_chat_line_is_counted_with_its_tools_and_template_arguments() -> None:
    engine = RenderingEngine()
    dispatcher = _dispatcher(cast(CountingEngine, engine))
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 2000}}]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": tools,
        "documents": [{"text": "e" * 700}],
        "add_generation_prompt": False,
        "max_tokens": 8,
    }

    (ready,), refused = asyncio.run(dispatcher.checker.check([_item(body, "/v1/chat/completions")]))
    assert not refused

    (sent,) = engine.bodies
    assert sent["tools"] == tools
    assert sent["add_generation_prompt"] is False
    assert sent["chat_template_kwargs"] == {"documents": [{"text": "e" * 700}]}
    assert ready.count.longest > 2700  # the schema and the document are part of the prompt
