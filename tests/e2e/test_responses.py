"""A Responses batch (``/v1/responses``) end to end: the real tiny vLLM engine, a worker
beside it, the API, Postgres and Redis; submitted through the openai SDK.

Every reservation is held to what the engine prefills for the same body asked directly (its
``usage.input_tokens``) plus the line's output budget, in whole blocks; every result line's
Response to the engine's own answer for that body (every field but ids and timestamps: the
lines run greedy); the Batch usage to the sum of the engine's counts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from sqlalchemy import text

from backfill.capacity import round_up_to_block
from backfill.config import Settings
from backfill.engine.http import HttpEngine
from backfill.engine_metrics import EngineLoad
from tests.e2e import helpers
from tests.e2e.helpers import block_size, node_beside, node_settings, run_batch
from tests.integration.batch_api_support import make_tenant, serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "tiny"
NODE = "resp-1"
# The tiny model's own template renders role and text alone: this one renders the tools too
# (and tool calls, which is how function call items were found to count short:
# backfill/responses.py refuses them), so their counting is held to the engine's rendering.
TEMPLATE = Path(__file__).resolve().parent / "templates" / "tools_chatml.jinja"
BLOCKS = 64
DEFAULT_MAX_TOKENS = 12
ABORT_REACHES_S = 2.0
"""How long the engine core stays stopped after a stream is closed, for the API server to
send the core the abort (a try whose abort came later is tried again)."""


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    yield from helpers.engine_url(
        MODEL,
        num_gpu_blocks_override=BLOCKS,
        max_model_len=512,
        kv_cache_gib=1,
        extra_args=("--chat-template", str(TEMPLATE)),
    )


def engine_answer(engine_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the engine answers for ``body`` asked directly, not streamed."""
    reply = httpx.post(f"{engine_url}/v1/responses", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def without_ids(response: dict[str, Any]) -> dict[str, Any]:
    """A Response without what differs between two runs of one request: its ids and time,
    and the prefix cache's hits (the second run of a prompt of whole blocks finds them
    cached)."""
    kept = {k: v for k, v in response.items() if k not in ("id", "created_at")}
    kept["output"] = [{k: v for k, v in item.items() if k != "id"} for item in response["output"]]
    details = dict(response["usage"]["input_tokens_details"])
    for key in ("cached_tokens", "cache_write_tokens"):
        details.pop(key)
    kept["usage"] = {**response["usage"], "input_tokens_details": details}
    return kept


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/responses",
        "body": {"model": MODEL, "temperature": 0, **body},
    }


LINES = [
    line("string", input="the fox and the hound", max_output_tokens=8),
    line(
        "instructions and parts",
        instructions="Answer in one word.",
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Name a colour."},
                    {"type": "input_text", "text": "Any will do."},
                ],
            }
        ],
        max_output_tokens=10,
    ),
    line(
        "conversation",
        input=[
            {"role": "developer", "content": "Keep it short."},
            {"role": "user", "content": "Hello"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hi there."}],
            },
            {"role": "user", "content": "What is a lease?"},
        ],
        max_output_tokens=6,
        top_p=0.9,
        metadata={"team": "batch"},
    ),
    line("defaulted", input="a line without an output budget", store=False),
    line(
        "continued",
        input=[
            {"role": "user", "content": "Finish the sentence."},
            {
                "type": "message",
                "role": "assistant",
                "status": "incomplete",
                "content": [{"type": "output_text", "text": "Tokens are"}],
            },
        ],
        max_output_tokens=5,
    ),
    line(
        "tools and text",
        input="Call the tool.",
        tools=[
            {
                "type": "function",
                "name": "lookup",
                "description": "Look a word up.",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
            }
        ],
        tool_choice="none",
        text={"format": {"type": "text"}},
        max_output_tokens=7,
    ),
    line(
        "tool turn",
        instructions="Use the tools.",
        input=[
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "Let me add them."},
            {"role": "user", "content": "Go on."},
        ],
        tools=[
            {
                "type": "function",
                "name": "add",
                "description": "Add two numbers.",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                },
                "strict": False,
            }
        ],
        max_output_tokens=6,
    ),
]


def test_a_responses_batch_reserves_what_the_engine_prefills_and_answers_as_it_does(
    settings: Settings, engine_url: str
) -> None:
    block = block_size(engine_url)
    s = node_settings(
        settings,
        work_budget_enabled=False,
        batch_default_max_tokens=DEFAULT_MAX_TOKENS,
    )
    with node_beside(s, NODE, engine_url) as beside:
        repo, ledger, node = beside.repo, beside.ledger, beside.node
        with serve(s) as api:
            client = api.client(make_tenant(repo, "resp").key)
            final = run_batch(client, repo, LINES, "/v1/responses", poll_s=0.2)
            assert final.request_counts is not None
            errors = client.files.content(final.error_file_id).text if final.error_file_id else ""
            assert (final.request_counts.total, final.request_counts.completed) == (7, 7), errors
            output = client.files.content(final.output_file_id or "").text.splitlines()

        results = {json.loads(x)["custom_id"]: json.loads(x) for x in output}
        assert set(results) == {x["custom_id"] for x in LINES}
        with repo.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT custom_id, reservation_tokens, prompt_tokens, max_output_tokens, "
                    "output_tokens FROM items WHERE job_id = :j"
                ),
                {"j": final.id},
            ).all()
        items = {r[0]: tuple(int(v) for v in r[1:]) for r in rows}

        prompt_total = output_total = 0
        prefilled_of: dict[str, int] = {}
        for request in LINES:
            name, body = request["custom_id"], request["body"]
            budget = body.get("max_output_tokens", DEFAULT_MAX_TOKENS)
            direct = engine_answer(engine_url, {**body, "max_output_tokens": budget})
            prefilled = prefilled_of[name] = direct["usage"]["input_tokens"]
            reserved, prompt, max_output, generated = items[name]
            # The invariant: the reservation covers the engine's prefill and the whole
            # output budget, in whole blocks, and no more than that.
            assert reserved == round_up_to_block(prefilled + budget, block), (name, prefilled)
            assert (prompt, max_output) == (prefilled, budget), name

            got = results[name]
            assert got["error"] is None, name
            response = got["response"]
            assert response["status_code"] == 200
            answer = response["body"]
            assert answer["object"] == "response"
            assert answer["model"] == MODEL
            assert answer["status"] in ("completed", "incomplete"), name
            assert answer["usage"]["input_tokens"] == prefilled, name
            assert generated == answer["usage"]["output_tokens"] <= budget, name
            assert without_ids(answer) == without_ids(direct), name
            prompt_total += prefilled
            output_total += generated

        # The template renders the tools: the count above covered them.
        tool_turn = next(x["body"] for x in LINES if x["custom_id"] == "tool turn")
        untooled = engine_answer(engine_url, {**tool_turn, "tools": []})
        assert prefilled_of["tool turn"] > untooled["usage"]["input_tokens"] + 20
        # The line without a budget ran on the default, written into its body.
        assert results["defaulted"]["response"]["body"]["max_output_tokens"] == DEFAULT_MAX_TOKENS
        # The Batch object's usage is the engine's counts, summed.
        assert final.usage is not None
        assert (final.usage.input_tokens, final.usage.output_tokens) == (
            prompt_total,
            output_total,
        )
        # Every lease went back, and the engine never held more than a lease covered.
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.batch_in_use == 0
        assert sum(d.stats.reservation_violations for d in node.dispatchers) == 0
        assert sum(d.stats.succeeded for d in node.dispatchers) == 7


async def _idle(client: HttpEngine, timeout_s: float = 15.0) -> EngineLoad:
    deadline = time.monotonic() + timeout_s
    while True:
        load = await client.load()
        if load.num_requests_running == 0 and load.num_requests_waiting == 0:
            return load
        assert time.monotonic() < deadline, f"engine still busy after {timeout_s} s: {load}"
        await asyncio.sleep(0.05)


class SessionEngine(Protocol):
    url: str
    pid: int | None


def test_closing_a_responses_stream_aborts_the_request_in_the_engine(
    engine: SessionEngine,
) -> None:
    """What a preemption does to a Responses attempt: the worker closes its stream, and the
    engine stops generating and frees the request's blocks."""
    budget = 450

    async def one_try() -> tuple[int, EngineLoad, EngineLoad] | None:
        async with HttpEngine(engine.url) as client:
            before = await _idle(client)
            deltas = 0
            stream = client.stream_responses(
                {"model": MODEL, "input": "Go", "max_output_tokens": budget, "ignore_eos": True},
                priority=10,
                request_id=f"abort-me-{time.monotonic_ns()}",
            )
            with contextlib.ExitStack() as core_stopped:
                async with stream:
                    async for event in stream:
                        if event.get("type") == "response.output_text.delta":
                            deltas += 1
                        if deltas >= 1 and engine.pid is not None:
                            # The engine core stopped while the close reaches it: a loaded
                            # machine's tiny engine finished all 450 tokens before a starved
                            # client's close did.
                            core_stopped.enter_context(helpers.engine_core_stopped(engine.pid))
                        if deltas >= 1:
                            break
                    else:
                        return None  # ended before it could be closed: nothing tested
                await asyncio.sleep(ABORT_REACHES_S)
            after = await _idle(client, timeout_s=30)
            return deltas, before, after

    for _ in range(8):
        outcome = asyncio.run(one_try())
        if outcome is None:
            continue
        deltas, before, after = outcome
        generated = after.generation_tokens_total - before.generation_tokens_total
        if generated < budget:
            break
        # The close reached the engine only after its core went on (a starved API server).
    else:
        pytest.fail(f"the engine generated all {budget} tokens in every try: no abort")
    assert deltas <= generated < budget
    assert after.kv_cache_usage_perc == 0.0
