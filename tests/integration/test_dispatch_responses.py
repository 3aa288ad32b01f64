"""A Responses item in the node dispatcher (real Postgres and Redis, a stand-in engine):
reserved on its prompt and whole output budget in blocks; streamed at the batch priority;
when preempted, the stream is closed (which drops the engine's connection: vLLM aborts the
request), its output so far is not kept, and the item runs again from the start to a result
that is the stream's final Response, with its usage as the item's tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

from backfill.cache_salt import cache_salt
from backfill.config import Settings
from backfill.engine.protocol import EventStream
from backfill.ledger import Lease, PoolSnapshot
from tests.integration.standin_engine import (
    StandInEngine,
    preempt_the_first_run,
    quick_dispatcher,
    stand_in_node,
    submit_one,
)
from worker.dispatch import DispatchConfig

NODE = "n-responses"
BLOCK = 16
PROMPT = 5  # what the stand-in's /tokenize says of any prompt
MAX_OUTPUT = 20


class Responder(StandInEngine):
    """Its first stream sends three deltas and then nothing until it is closed; the later
    ones answer at once."""

    def __init__(self) -> None:
        super().__init__(blocks=64, block=BLOCK)
        self.calls: list[tuple[str, dict[str, Any], int]] = []
        self.closed = 0
        self.first_held = asyncio.Event()

    def stream_responses(
        self, body: Mapping[str, Any], *, priority: int, request_id: str
    ) -> EventStream:
        self.calls.append((request_id, dict(body), priority))
        first = len(self.calls) == 1

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield {"type": "response.created", "response": {"id": request_id, "output": []}}
            for word in ("a", " b", " c"):
                yield {"type": "response.output_text.delta", "delta": word}
            if first:
                try:
                    self.first_held.set()
                    await asyncio.Event().wait()
                finally:
                    self.closed += 1
            yield {
                "type": "response.completed",
                "response": {
                    "id": request_id,
                    "object": "response",
                    "model": body["model"],
                    "status": "completed",
                    "output": [
                        {
                            "type": "message",
                            "role": "assistant",
                            "content": [{"type": "output_text", "text": "a b c"}],
                        }
                    ],
                    "usage": {"input_tokens": PROMPT, "output_tokens": 3, "total_tokens": 8},
                },
            }

        return EventStream(events())


def test_a_preempted_response_is_aborted_and_runs_again_from_the_start(
    settings: Settings,
) -> None:
    engine = Responder()
    body = {"model": "m", "input": "a question", "max_output_tokens": MAX_OUTPUT, "store": False}
    with stand_in_node(settings, NODE, BLOCK) as (repo, ledger, aledger):
        job = submit_one(repo, "t-responses", "/v1/responses", "r", body, MAX_OUTPUT)
        dispatcher = quick_dispatcher(NODE, engine, repo, aledger, BLOCK, work_budget=None)

        def check(running: dict[str, Any], snap: PoolSnapshot, lease: Lease) -> None:
            # The prompt and the whole output budget, in whole blocks.
            assert running["reservation_tokens"] == 2 * BLOCK  # 5 + 20 -> 32
            assert running["prompt_tokens"] == PROMPT
            assert lease.tokens == 2 * BLOCK

        stores = (repo, ledger, aledger)
        done = preempt_the_first_run(dispatcher, stores, NODE, job, engine.first_held, check)

        assert engine.closed == 1  # the preempted stream was closed: the engine aborts it
        ((first, sent, priority), (second, resent, _)) = engine.calls
        # From the start (the earlier deltas are not continued), in the tenant's cache salt.
        tenant_id = repo.jobs.get_job(None, job).tenant_id
        assert sent == resent == {**body, "cache_salt": cache_salt(tenant_id)}
        assert priority == DispatchConfig(node=NODE).batch_priority
        assert (first.rsplit("-", 1)[1], second.rsplit("-", 1)[1]) == ("1", "2")
        assert (done["attempt"], done["preemptions"]) == (2, 1)
        assert done["reservation_tokens"] == 2 * BLOCK  # the rerun reserves the whole budget
        assert (done["prompt_tokens"], done["output_tokens"]) == (PROMPT, 3)
        result = json.loads(done["result"])
        assert (result["object"], result["model"], result["id"]) == ("response", "m", second)
        assert result["output"][0]["content"][0]["text"] == "a b c"
        assert (dispatcher.stats.preempted, dispatcher.stats.succeeded) == (1, 1)
        assert dispatcher.stats.reservation_violations == 0
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.batch_in_use == 0
