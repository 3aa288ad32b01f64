"""An embeddings item in the node dispatcher (real Postgres and Redis, a stand-in engine):
reserved on its prompt alone, one block-rounded sequence per input; sent as one
non-streaming call at the batch priority; when preempted, the call is cancelled (which drops
the engine's connection: vLLM aborts the request), nothing partial is kept, and the item runs
again from the start to a result in OpenAI's embedding shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from backfill.config import Settings
from backfill.ledger import Lease, PoolSnapshot
from backfill.prefill import embedding_inputs
from tests.integration.standin_engine import (
    StandInEngine,
    preempt_the_first_run,
    quick_dispatcher,
    stand_in_node,
    submit_one,
)
from worker.dispatch import DispatchConfig

NODE = "n-embed"
BLOCK = 16


class Embedder(StandInEngine):
    """Its first embeddings call never answers on its own, the later ones answer at once
    (inputs are token ids: counted without the engine)."""

    def __init__(self) -> None:
        super().__init__(blocks=64, block=BLOCK)
        self.calls: list[tuple[str, dict[str, Any], int]] = []
        self.cancelled = 0
        self.first_started = asyncio.Event()

    async def embed(
        self, body: Mapping[str, Any], *, priority: int, request_id: str
    ) -> dict[str, Any]:
        self.calls.append((request_id, dict(body), priority))
        if len(self.calls) == 1:
            self.first_started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        inputs = embedding_inputs(body["input"])
        tokens = sum(len(i) for i in inputs)
        return {
            "id": f"embd-{request_id}",
            "object": "list",
            "created": 1,
            "model": body["model"],
            "data": [
                {"index": i, "object": "embedding", "embedding": [0.25 * i, -0.5]}
                for i in range(len(inputs))
            ],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }


def test_a_preempted_embedding_is_aborted_and_runs_again_from_the_start(
    settings: Settings,
) -> None:
    engine = Embedder()
    # The longest input is exactly one block: with a single output token it would take two.
    body = {"model": "m", "input": [[7] * BLOCK, [8] * 3]}
    with stand_in_node(settings, NODE, BLOCK) as (repo, ledger, aledger):
        job = submit_one(repo, "t-embed", "/v1/embeddings", "e", body, 0)
        dispatcher = quick_dispatcher(NODE, engine, repo, aledger, BLOCK, work_budget=None)

        def check(running: dict[str, Any], snap: PoolSnapshot, lease: Lease) -> None:
            # Two inputs, each charged the longest (one block), and no output on top.
            assert running["reservation_tokens"] == 2 * BLOCK
            assert running["prompt_tokens"] == BLOCK + 3
            assert (lease.tokens, snap.batch_in_use) == (2 * BLOCK, 2 * BLOCK)

        stores = (repo, ledger, aledger)
        done = preempt_the_first_run(dispatcher, stores, NODE, job, engine.first_started, check)

        assert engine.cancelled == 1
        ((first, sent, priority), (second, resent, _)) = engine.calls
        assert (sent, resent) == (body, body)  # from the start: nothing partial to continue
        assert priority == DispatchConfig(node=NODE).batch_priority
        assert (first.rsplit("-", 1)[1], second.rsplit("-", 1)[1]) == ("1", "2")
        assert (done["attempt"], done["preemptions"]) == (2, 1)
        assert (done["partial_output"], done["partial_tokens"]) == (None, 0)
        result = json.loads(done["result"])
        assert result["object"] == "list"
        assert result["model"] == "m"
        assert [d["index"] for d in result["data"]] == [0, 1]
        assert result["usage"] == {"prompt_tokens": BLOCK + 3, "total_tokens": BLOCK + 3}
        assert (dispatcher.stats.preempted, dispatcher.stats.succeeded) == (1, 1)
        assert dispatcher.stats.reservation_violations == 0
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.batch_in_use == 0
