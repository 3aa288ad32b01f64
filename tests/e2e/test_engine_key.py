"""An engine that answers only Backfill: started with its own key (vLLM's ``--api-key``), it
refuses anyone else, so nobody can send it work beside Backfill's ledger nor set the priority
its step scheduler pauses by; the worker and the gateway hold the key
(``BACKFILL_ENGINE_API_KEY``) and run a batch job and interactive requests through it."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
from pydantic import SecretStr

from backfill.config import Settings
from devkit import devengine
from tests.e2e import helpers
from tests.e2e.helpers import node_beside, node_settings, run_batch
from tests.integration.batch_api_support import make_tenant, serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NODE = "engine-key-node"
MODEL = "tiny"
KEY = secrets.token_urlsafe(24)


@pytest.fixture(scope="module")
def keyed_engine() -> Iterator[devengine.EngineServer]:
    yield from helpers.engine_server(
        MODEL, max_model_len=512, kv_cache_gib=1, scheduler=True, api_key=KEY
    )


def test_only_holders_of_the_engine_key_reach_it_and_backfill_runs_through_it(
    settings: Settings, keyed_engine: devengine.EngineServer
) -> None:
    url = keyed_engine.url
    body = {"model": MODEL, "prompt": "the fox", "max_tokens": 4, "priority": 0}
    # A stranger cannot send work, nor claim an interactive priority that pauses batch.
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        refused = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30)
        assert refused.status_code == 401, refused.text
    allowed = httpx.post(
        f"{url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert allowed.status_code == 200, allowed.text

    s = node_settings(settings, work_budget_enabled=False, engine_api_key=SecretStr(KEY))
    with node_beside(s, NODE, url) as beside, serve(s) as api:
        client = api.client(make_tenant(beside.repo, "keyed").key)
        lines = [
            {
                "custom_id": f"c{k}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"document {k}", "max_tokens": 8},
            }
            for k in range(6)
        ]
        final = run_batch(client, beside.repo, lines, "/v1/completions", poll_s=0.1)
        assert final.request_counts is not None
        assert (final.request_counts.total, final.request_counts.completed) == (6, 6)
        # The gateway sends the engine's key, never the caller's (a tenant's key is no
        # engine key).
        answer = client.completions.create(model=MODEL, prompt="the hound", max_tokens=4)
        assert answer.usage is not None
        assert 0 < answer.usage.completion_tokens <= 4
