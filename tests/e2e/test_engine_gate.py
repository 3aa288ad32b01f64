"""Backfill's engine gate (``queue_api/engine_gate.py``) inside a real vLLM server
(``--middleware``): a tenant's interactive request goes straight to the engine's port and is
admitted, leased on the engine's own node and settled there, as the central gateway does it;
the engine's own key (the worker's) passes untouched; any other caller is refused as OpenAI
refuses a bad key, and reaches no other route.

Stock vLLM with ``--api-key`` refuses a tenant's key outright, and without it serves anyone
with no lease at all: every test here fails on it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import redis

from backfill.config import Settings
from backfill.engine.local_tokenizer import CHECKS
from backfill.ledger import Ledger, PoolSnapshot
from tests.conftest import REDIS_URL
from tests.e2e import helpers
from tests.e2e.helpers import node_beside, wait
from tests.integration.batch_api_support import Tenant, make_tenant

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "tiny"
NODE = "gate0"
ENGINE_KEY = f"engine-{secrets.token_hex(12)}"


@dataclass
class Gated:
    url: str
    ledger: Ledger
    tenant: Tenant

    def sdk(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            api_key=key or self.tenant.key,
            base_url=f"{self.url}/v1",
            max_retries=0,
            timeout=60,
        )

    def snapshot(self) -> PoolSnapshot:
        snap = self.ledger.snapshot(NODE)
        assert snap is not None
        return snap

    def tenant_leases(self) -> list[str]:
        owner = f"gateway/{self.tenant.id}"
        return [lease.lease_id for lease in self.snapshot().leases if lease.owner == owner]


@pytest.fixture(scope="module")
def gated(module_database_url: str) -> Iterator[Gated]:
    namespace = f"bfgate{secrets.token_hex(4)}"
    settings = Settings(
        database_url=module_database_url,
        redis_url=REDIS_URL,
        redis_namespace=namespace,
        engine_api_key=ENGINE_KEY,
        lease_ttl_s=6.0,
        heartbeat_interval_s=1.0,
        shutdown_grace_s=3.0,
        work_budget_enabled=False,
    )
    gate = {
        "BACKFILL_DATABASE_URL": module_database_url,
        "BACKFILL_REDIS_URL": REDIS_URL,
        "BACKFILL_REDIS_NAMESPACE": namespace,
        "BACKFILL_GATE_NODE": NODE,
        "BACKFILL_ENGINE_API_KEY": ENGINE_KEY,
        "BACKFILL_LEASE_TTL_S": "6",
        "BACKFILL_HEARTBEAT_INTERVAL_S": "1",
        "BACKFILL_WORK_BUDGET_ENABLED": "false",
    }
    try:
        for server in helpers.engine_server(
            MODEL,
            "a vLLM engine with Backfill's engine gate",
            api_key=ENGINE_KEY,
            gate_settings=gate,
            num_gpu_blocks_override=48,
            max_model_len=512,
            kv_cache_gib=1,
        ):
            with node_beside(settings, NODE, server.url, start_timeout_s=60) as beside:
                yield Gated(server.url, beside.ledger, make_tenant(beside.repo, "gated"))
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for key in client.scan_iter(match=f"{namespace}:*", count=1000):
            client.delete(key)
        client.close()


def _events(response: httpx.Response) -> Iterator[dict[str, object]]:
    for line in response.iter_lines():
        if line.startswith("data:") and "[DONE]" not in line:
            yield json.loads(line[5:])


def test_a_tenants_stream_is_leased_on_the_engines_node_and_the_lease_ends_with_it(
    gated: Gated,
) -> None:
    body = {
        "model": MODEL,
        "prompt": "The gate keeps the room:",
        "max_tokens": 24,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {gated.tenant.key}"}
    held: list[str] = []
    events = []
    with httpx.stream(
        "POST", f"{gated.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["x-backfill-node"] == NODE
        for event in _events(response):
            if not held:
                held = gated.tenant_leases()  # the stream runs on the tenant's lease
            events.append(event)
    assert held, "no lease of the tenant's on the node while its stream ran"
    texts = [c for e in events for c in e["choices"]]  # type: ignore[attr-defined]
    assert len(texts) == 24
    # The gate asks the engine for the usage (to settle) and drops it: not asked for here.
    assert all(e.get("usage") is None for e in events)
    wait(lambda: not gated.tenant_leases(), 5, "the tenant's lease to end with its stream")
    assert gated.snapshot().interactive_in_use == 0


def test_the_openai_sdk_works_through_the_gate_and_usage_comes_when_asked(gated: Gated) -> None:
    assert helpers.chat_and_stream(gated.sdk(), MODEL, max_tokens=6)
    assert not gated.tenant_leases()


def test_the_engines_key_passes_without_a_lease_and_other_callers_are_refused(
    gated: Gated,
) -> None:
    body = {"model": MODEL, "prompt": "worker", "max_tokens": 16, "ignore_eos": True}
    engine = {"Authorization": f"Bearer {ENGINE_KEY}"}
    leases: list[int] = []
    with httpx.stream(
        "POST", f"{gated.url}/v1/completions", json={**body, "stream": True}, headers=engine
    ) as response:
        assert response.status_code == 200
        assert "x-backfill-node" not in response.headers
        for _ in _events(response):
            leases.append(gated.snapshot().interactive_in_use)
    assert leases
    assert max(leases) == 0, "the worker's own request took an interactive lease"

    for authorization in ({"Authorization": "Bearer sk-not-a-key"}, {}):
        refused = httpx.post(
            f"{gated.url}/v1/completions", json=body, headers=authorization, timeout=30
        )
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError) as bad:
        gated.sdk("sk-not-a-key").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert bad.value.code == "invalid_api_key"
    # A tenant's key opens the two interactive routes only: every other route is the engine's.
    other = httpx.get(
        f"{gated.url}/v1/models", headers={"Authorization": f"Bearer {gated.tenant.key}"}
    )
    assert other.status_code == 401


def test_a_request_over_the_context_is_refused_by_the_gate_with_the_limit(gated: Gated) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        gated.sdk().completions.create(model=MODEL, prompt="word " * 100, max_tokens=500)
    assert refused.value.code == "context_length_exceeded"
    error = refused.value.body
    assert isinstance(error, dict)
    assert error.get("limit") == 512
    assert not gated.tenant_leases()


def test_a_caller_that_leaves_mid_stream_ends_its_lease_and_its_engine_request(
    gated: Gated,
) -> None:
    body = {
        "model": MODEL,
        "prompt": "A long story:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {gated.tenant.key}"}
    with httpx.stream(
        "POST", f"{gated.url}/v1/completions", json=body, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        first = next(_events(response))
        assert first["choices"]
        assert gated.tenant_leases(), "no lease while the stream runs"
    left = time.monotonic()
    wait(lambda: not gated.tenant_leases(), 5, "the lease to end once the caller left")

    def running() -> float:
        text = httpx.get(f"{gated.url}/metrics", timeout=10).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )

    wait(lambda: running() == 0, 10, "the engine to abort the request")
    assert time.monotonic() - left < 10


def _tokenize_calls(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    calls = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("http_requests_total{") and 'handler="/tokenize"' in line
    ]
    assert calls, "the engine's /metrics counts no /tokenize request at all"
    return sum(calls)


def test_plain_prompts_are_counted_by_the_engines_tokenizer_file_not_its_api_server(
    gated: Gated,
) -> None:
    """The gate counts a bound admission's prompt exactly once it streams; by the model's own
    tokenizer file once that has agreed with the engine (``local_tokenizer.CHECKS`` counts),
    not by a ``/tokenize`` request to the API server the stream runs in (~4 ms of its CPU
    apiece on this machine, which the stream's tokens waited behind)."""
    client = gated.sdk()

    def one(i: int) -> None:
        prompt = f"{i}: count these words please"
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
        assert [c.choices[0].text for c in stream if c.choices]

    for i in range(CHECKS + 2):  # the file proves itself against the engine's counts
        one(i)
    before = _tokenize_calls(gated.url)
    for i in range(20):
        one(100 + i)
    # Red before: one /tokenize per request (20).
    assert _tokenize_calls(gated.url) - before <= 1
    assert not gated.tenant_leases()
