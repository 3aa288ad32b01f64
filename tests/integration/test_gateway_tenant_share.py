"""One tenant's flood of interactive requests cannot make another tenant's request wait or be
refused: a tenant's requests may hold at most ``BACKFILL_GATEWAY_TENANT_SHARE`` of a node, and
the next one is refused (429 ``tenant_interactive_share``, with ``Retry-After``) while another
tenant under its share is admitted on the same node.

Before, tenant A's requests filled the node's whole pool and tenant B's request got a 429
``interactive_capacity_exhausted``.

Real Postgres and Redis through the live API, in front of an engine stand-in over HTTP that
holds every request until the test lets it answer (so A's leases stay held while B asks). The
prompts are token ids: nothing to count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from batch_api_support import Tenant, api_settings, make_tenant, serve
from fastapi import FastAPI

from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import ensure_ledger, pool_policy
from backfill.policy import ServiceClass
from backfill.store import Repository
from devkit.harness import free_port
from queue_api import gateway_metrics

NODE = "n-share"
BLOCK = 16
BLOCKS = 256  # 4096 tokens: a tenant's half is 2048, two requests of 1024
PROMPT = [1, 2, 3]
MAX_TOKENS = 1024 - len(PROMPT)  # each request reserves 1024 tokens
FLOOD = 6


class HeldEngine:
    """An engine stand-in that answers each completion only once ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.app = FastAPI()
        self.app.get("/v1/models")(self.models)
        self.app.post("/v1/completions")(self.complete)

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "m", "max_model_len": BLOCKS * BLOCK}]}

    async def complete(self) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while not self.release.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return {
            "id": "cmpl-held",
            "object": "text_completion",
            "created": 0,
            "model": "m",
            "choices": [{"index": 0, "text": "ok", "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        }


@contextmanager
def serve_engine(engine: HeldEngine) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(engine.app, host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the engine stand-in did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        engine.release.set()
        server.should_exit = True
        thread.join(timeout=10)


class Node:
    def __init__(self, base_url: str, ledger: Ledger, engine: HeldEngine) -> None:
        self.base_url = base_url
        self.ledger = ledger
        self.engine = engine

    def complete(self, tenant: Tenant) -> httpx.Response:
        return httpx.post(
            f"{self.base_url}/v1/completions",
            json={"model": "m", "prompt": PROMPT, "max_tokens": MAX_TOKENS},
            headers={"Authorization": f"Bearer {tenant.key}", "X-Backfill-Max-Wait": "0"},
            timeout=60,
        )

    def held_by(self, tenant: Tenant) -> int:
        """The interactive leases ``tenant``'s requests hold on the node."""
        snap = self.ledger.snapshot(NODE)
        assert snap is not None
        return sum(
            1
            for lease in snap.leases
            if lease.service_class is ServiceClass.INTERACTIVE
            and lease.owner == f"gateway/{tenant.id}"
        )


@pytest.fixture
def tenants(settings: Settings) -> Iterator[tuple[Node, Tenant, Tenant]]:
    s = api_settings(
        settings,
        gateway_tenant_share=0.5,
        gateway_bound_admission=False,
        gateway_max_wait_s=0.0,
    )
    repo = Repository.connect(s.database_url, pool_size=4)
    ledger = Ledger.from_url(s.redis_url, s.redis_namespace, pool_policy(s))
    engine = HeldEngine()
    try:
        with serve_engine(engine) as engine_url:
            repo.nodes.upsert_node(NODE, engine_url, "m", BLOCKS, BLOCK, 0)
            ensure_ledger(repo, ledger, max_preemptions=3)
            a, b = make_tenant(repo, "flooder"), make_tenant(repo, "neighbour")
            with serve(s) as api:
                yield Node(api.base_url, ledger, engine), a, b
    finally:
        ledger.close()
        repo.close()


def rejections(reason: str) -> float:
    value: float = gateway_metrics.REJECTIONS.labels(reason)._value.get()
    return value


def wait_for(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_tenants_flood_cannot_make_another_tenants_request_get_429(
    tenants: tuple[Node, Tenant, Tenant],
) -> None:
    node, a, b = tenants
    refused_before = rejections("tenant_share")
    with ThreadPoolExecutor(max_workers=FLOOD + 1) as pool:
        flood = [pool.submit(node.complete, a) for _ in range(FLOOD)]
        # Each of A's requests is held by the engine, or answered at once (it waits 0 s).
        wait_for(
            lambda: node.held_by(a) + sum(f.done() for f in flood) == FLOOD,
            "A's flood was not all decided",
        )

        # B, under its share, is admitted beside A's flood, without waiting.
        mine = pool.submit(node.complete, b)
        wait_for(lambda: mine.done() or node.held_by(b) == 1, "B's request was not decided")
        if mine.done():
            reply = mine.result()
            pytest.fail(f"B's request was answered {reply.status_code} at once: {reply.text}")

        # A holds its share, and the rest of its flood was refused naming the bound.
        assert node.held_by(a) == 2
        refused = [f.result() for f in flood if f.done()]
        assert [r.status_code for r in refused] == [429] * (FLOOD - 2), [r.text for r in refused]
        for reply in refused:
            assert reply.json()["error"]["code"] == "tenant_interactive_share", reply.text
            assert int(reply.headers["Retry-After"]) >= 1
        assert rejections("tenant_share") - refused_before == FLOOD - 2

        node.engine.release.set()
        reply = mine.result(timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.headers["X-Backfill-Node"] == NODE
        answers = [f.result(timeout=30).status_code for f in flood]
        assert sorted(answers) == [200] * 2 + [429] * (FLOOD - 2)
    # Every lease was given back.
    wait_for(lambda: not node.held_by(a) and not node.held_by(b), "leases left held")
