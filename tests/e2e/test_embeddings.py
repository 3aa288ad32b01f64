"""An embeddings batch (``/v1/embeddings``) end to end: a real vLLM engine serving the tiny
model as an embedding model (its pooling runner), a worker beside it, the API, Postgres and
Redis; submitted through the openai SDK.

Every result line is checked field by field against what the engine answers when asked
directly for the same body (the vectors and the usage), every reservation against the
engine's own prompt counts (the prompt alone, in whole blocks per input: an embedding
generates nothing), and the Batch object's usage against the sum of those counts.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sqlalchemy import text

from backfill.capacity import round_up_to_block
from backfill.config import Settings
from backfill.prefill import embedding_inputs
from tests.e2e import helpers
from tests.e2e.helpers import block_size, node_beside, node_settings, run_batch
from tests.integration.batch_api_support import jsonl, make_tenant, serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "tiny-embed"
NODE = "emb-1"
BLOCKS = 48


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    yield from helpers.engine_url(
        MODEL,
        what="a vLLM embedding engine",
        num_gpu_blocks_override=BLOCKS,
        max_model_len=512,
        kv_cache_gib=1,
    )


def engine_answer(engine_url: str, body: dict[str, Any]) -> dict[str, Any]:
    """What the engine answers for ``body`` asked directly."""
    reply = httpx.post(f"{engine_url}/v1/embeddings", json={**body, "model": MODEL}, timeout=120)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    return answer


def vector(entry: dict[str, Any]) -> list[float]:
    value = entry["embedding"]
    if isinstance(value, str):  # base64: little-endian float32, as the openai SDK reads it
        raw = base64.b64decode(value)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    assert all(isinstance(x, float) for x in value)
    return list(value)


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=1e-4) for x, y in zip(a, b, strict=False)
    )


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": MODEL, **body},
    }


def test_an_embeddings_batch_runs_end_to_end_on_its_prompt_tokens_alone(
    settings: Settings, engine_url: str
) -> None:
    block = block_size(engine_url)
    lines = [
        line("text", input="the fox and the hound"),
        line("texts", input=["a queue", "the deadline of the job " * 4, "x"]),
        line("ids", input=[5, 6, 7, 8, 9]),
        line("id lists", input=[[1, 2, 3], [4] * 30]),
        line("base64", input="tokens are capacity", encoding_format="base64"),
        # Exactly one block of prompt: with a single output token it would take two.
        line("one block", input=[11] * block),
        line("no special tokens", input="the lease", add_special_tokens=False),
    ]
    # Each line's inputs, one sequence each.
    inputs = {x["custom_id"]: embedding_inputs(x["body"]["input"]) for x in lines}
    s = node_settings(
        settings,
        work_budget_enabled=False,
    )
    with node_beside(s, NODE, engine_url) as beside:
        repo, ledger, node = beside.repo, beside.ledger, beside.node
        # The node registers the model its engine serves, so the batch is accepted for it,
        # and the endpoints its pooling engine mounts: embeddings, no generation.
        assert MODEL in repo.nodes.served_models(s.node_live_s)[0]
        assert repo.nodes.served_endpoints(MODEL, s.node_live_s) == {"/v1/embeddings"}
        with serve(s) as api:
            client = api.client(make_tenant(repo, "emb").key)
            # A chat batch naming the embedding model is refused at create, not failed late
            # on the engine's 404 after its retries.
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            chat_line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions"}
            chat_upload = client.files.create(
                file=("chat.jsonl", jsonl([{**chat_line, "body": {**chat, "max_tokens": 4}}])),
                purpose="batch",
            )
            with pytest.raises(openai.NotFoundError) as refused:
                client.batches.create(
                    input_file_id=chat_upload.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
            assert refused.value.code == "model_not_found"
            assert "served for: /v1/embeddings" in refused.value.message
            final = run_batch(client, repo, lines, "/v1/embeddings", poll_s=0.1)
            assert final.request_counts is not None
            assert (final.request_counts.total, final.request_counts.completed) == (7, 7)
            assert final.error_file_id is None
            output = client.files.content(final.output_file_id or "").text.splitlines()

        results = {json.loads(x)["custom_id"]: json.loads(x) for x in output}
        assert set(results) == set(inputs)
        width = len(vector(results["text"]["response"]["body"]["data"][0]))
        assert width == 128  # the tiny model's hidden size
        # Each input's own count, as the engine prefills it (usage of it alone).
        counts: dict[str, list[int]] = {}
        for request in lines:
            name, body = request["custom_id"], request["body"]
            expected = engine_answer(engine_url, body)
            counts[name] = [
                engine_answer(engine_url, {**body, "input": one})["usage"]["prompt_tokens"]
                for one in inputs[name]
            ]
            got = results[name]
            assert set(got) == {"id", "custom_id", "response", "error"}, name
            assert got["id"].startswith("batch_req_")
            assert got["error"] is None
            response = got["response"]
            assert response["status_code"] == 200
            assert response["request_id"].startswith(f"req_{final.id}_")
            answer = response["body"]
            assert answer["object"] == "list", name
            assert answer["model"] == MODEL
            assert answer["usage"]["prompt_tokens"] == sum(counts[name]), name
            assert answer["usage"]["total_tokens"] == answer["usage"]["prompt_tokens"]
            assert answer["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
            assert len(answer["data"]) == len(inputs[name]), name
            for index, (entry, direct) in enumerate(
                zip(answer["data"], expected["data"], strict=True)
            ):
                assert entry["object"] == "embedding"
                assert entry["index"] == index
                assert isinstance(entry["embedding"], str) == (name == "base64"), name
                assert len(vector(entry)) == width
                assert close(vector(entry), vector(direct)), (name, index)

        with repo.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT custom_id, reservation_tokens, prompt_tokens, max_output_tokens, "
                    "output_tokens FROM items WHERE job_id = :j"
                ),
                {"j": final.id},
            ).all()
        items = {r[0]: tuple(int(v) for v in r[1:]) for r in rows}
        for name, per_input in counts.items():
            reserved, prompt, max_output, output = items[name]
            # The prompt alone, every input a sequence of its own in whole blocks.
            assert reserved == len(per_input) * round_up_to_block(max(per_input), block), name
            assert (prompt, max_output, output) == (sum(per_input), 0, 0), name
        assert items["one block"][0] == block
        assert items["id lists"][0] == 2 * round_up_to_block(30, block)
        # The Batch object's usage counts every input token, and no output.
        assert final.usage is not None
        total_prompt = sum(sum(c) for c in counts.values())
        assert (final.usage.input_tokens, final.usage.output_tokens) == (total_prompt, 0)
        assert final.usage.total_tokens == total_prompt
        # Every lease went back, and the engine never held more than a lease covered.
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.batch_in_use == 0
        assert sum(d.stats.reservation_violations for d in node.dispatchers) == 0
        assert sum(d.stats.succeeded for d in node.dispatchers) == 7
