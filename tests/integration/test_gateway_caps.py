"""What one interactive request may ask of the gateway is capped: sequences
(``BACKFILL_GATEWAY_MAX_SEQUENCES``), KV tokens reserved over all of them
(``BACKFILL_GATEWAY_MAX_REQUEST_TOKENS``), and the wait for room (``X-Backfill-Max-Wait``, clamped
to ``BACKFILL_GATEWAY_MAX_WAIT_CAP_S`` and said so in ``X-Backfill-Max-Wait-Applied``).

Before, one request with a large ``n x max_tokens`` preempted all batch on a node, and a
caller could hold a request (and its pending signal, which holds batch back) for as long as
it liked. A request over a cap is refused with a 400 naming the parameter, before any
reservation: batch keeps its room.

Real Postgres and Redis through the live API. No engine is needed: the prompts are token ids
(nothing to count), and what is refused never reaches one; what is admitted meets an engine
that is not there (503), which is enough to see it was not refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from batch_api_support import LiveServer, Tenant, api_settings, make_tenant, serve

from backfill.config import Settings
from backfill.ledger import Lease, Ledger
from backfill.maintenance import ensure_ledger, pool_policy
from backfill.policy import ServiceClass
from backfill.store import Repository

NODE = "n-caps"
BLOCK = 16
BLOCKS = 256  # 4096 tokens
CAP_TOKENS = 1000
CAP_SEQUENCES = 4
CAP_WAIT_S = 0.3


class Caps:
    def __init__(self, api: LiveServer, tenant: Tenant, ledger: Ledger) -> None:
        self.api = api
        self.tenant = tenant
        self.ledger = ledger

    def complete(self, body: dict[str, Any], **headers: str) -> httpx.Response:
        return httpx.post(
            f"{self.api.base_url}/v1/completions",
            json={"model": "m", "prompt": [1, 2, 3], **body},
            headers={"Authorization": f"Bearer {self.tenant.key}", **headers},
            timeout=20,
        )

    def leases(self) -> set[str]:
        snap = self.ledger.snapshot(NODE)
        assert snap is not None
        return {lease.lease_id for lease in snap.leases}


@pytest.fixture
def caps(settings: Settings) -> Iterator[Caps]:
    s = api_settings(
        settings,
        gateway_max_request_tokens=CAP_TOKENS,
        gateway_max_sequences=CAP_SEQUENCES,
        gateway_max_wait_cap_s=CAP_WAIT_S,
        gateway_max_wait_s=0.1,
        gateway_bound_admission=False,
    )
    repo = Repository.connect(s.database_url, pool_size=4)
    ledger = Ledger.from_url(s.redis_url, s.redis_namespace, pool_policy(s))
    try:
        repo.nodes.upsert_node(NODE, "http://127.0.0.1:9", "m", BLOCKS, BLOCK, 0)
        ensure_ledger(repo, ledger, max_preemptions=3)
        tenant = make_tenant(repo, "caller")
        with serve(s) as api:
            yield Caps(api, tenant, ledger)
    finally:
        ledger.close()
        repo.close()


def _error(reply: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = reply.json()["error"]
    return error


def test_more_sequences_than_the_cap_are_refused_naming_n(caps: Caps) -> None:
    reply = caps.complete({"max_tokens": 8, "n": CAP_SEQUENCES + 1})
    assert reply.status_code == 400, reply.text
    error = _error(reply)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "n"
    assert str(CAP_SEQUENCES) in error["message"]


def test_a_list_of_prompts_counts_each_as_a_sequence(caps: Caps) -> None:
    prompts = [[1, 2, 3]] * (CAP_SEQUENCES + 1)
    reply = caps.complete({"prompt": prompts, "max_tokens": 8})
    assert reply.status_code == 400, reply.text
    assert _error(reply)["param"] == "prompt"


def test_n_times_max_tokens_over_the_cap_is_refused_and_preempts_no_batch(caps: Caps) -> None:
    batch = caps.ledger.reserve(NODE, ServiceClass.BATCH, 100, 2900, ttl_ms=60_000)
    assert isinstance(batch, Lease)
    # 4 x (3 + 300) tokens: within the class limit and the pool, over the request cap; and
    # more than the room interactive has without preempting that batch lease.
    reply = caps.complete({"max_tokens": 300, "n": 4})
    assert reply.status_code == 400, reply.text
    error = _error(reply)
    assert error["param"] == "max_tokens"
    assert error["limit"] == CAP_TOKENS
    assert str(CAP_TOKENS) in error["message"]
    assert batch.lease_id in caps.leases()


def test_a_request_within_the_caps_is_not_refused_by_them(caps: Caps) -> None:
    reply = caps.complete({"max_tokens": 100, "n": 2})
    # Admitted, then the engine is not there: 503, not a refusal of the request.
    assert reply.status_code == 503, reply.text


def test_a_wait_over_the_cap_is_clamped_and_said_so(caps: Caps) -> None:
    held = caps.ledger.reserve(NODE, ServiceClass.INTERACTIVE, 0, BLOCKS * BLOCK, ttl_ms=60_000)
    assert isinstance(held, Lease)
    started = time.monotonic()
    reply = caps.complete({"max_tokens": 8}, **{"X-Backfill-Max-Wait": "3600"})
    assert reply.status_code == 429, reply.text
    assert reply.headers["X-Backfill-Max-Wait-Applied"] == f"{CAP_WAIT_S:g}"
    assert time.monotonic() - started < 15  # nowhere near the hour asked for
    # Within the cap, the caller's wait stands and no header is added.
    within = caps.complete({"max_tokens": 8}, **{"X-Backfill-Max-Wait": "0.1"})
    assert within.status_code == 429, within.text
    assert "X-Backfill-Max-Wait-Applied" not in within.headers
