"""The tenant's rate check of an interactive request runs beside the read and parse of its
body (issue 40): its round trip to Redis leaves the request's path, and nothing else moves.
The gateway waits for the answer before it reserves or refuses anything, so a caller over its
rate gets the same 429 as when the edge waited first, with nothing reserved, whatever its body.

Real Postgres and Redis through the live API; the tenant's limiter is held at its round trip
(a stand-in that answers when the test says) to see what the gateway does meanwhile. No engine
is needed: the prompts are token ids, and an admitted request meets an engine that is not
there (503).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from batch_api_support import LiveServer, Tenant, api_settings, make_tenant, serve

from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import ensure_ledger, pool_policy
from backfill.ratelimit import RateDecision, RateLimiter
from backfill.store import Repository

NODE = "n-rate"
WAIT_S = 20.0
"""Generous bound on waiting for an event the test expects (never a timing assertion)."""


@dataclass
class HeldLimiter:
    """The tenants' limiter, its round trip held until :attr:`answer` is set."""

    real: RateLimiter
    allowed: bool = False
    asked: threading.Event = field(default_factory=threading.Event)
    answer: threading.Event = field(default_factory=threading.Event)

    @property
    def checks_async(self) -> bool:
        return True

    def check(self, tenant_id: str, cost: int = 1) -> RateDecision:
        return self.real.check(tenant_id, cost)

    def spend_credit(self, tenant_id: str, cost: int = 1) -> bool:
        return False

    async def acheck(self, tenant_id: str, cost: int = 1) -> RateDecision:
        self.asked.set()
        while not self.answer.is_set():
            await asyncio.sleep(0.005)
        return RateDecision(True) if self.allowed else RateDecision(False, 2.0)


@dataclass
class Stack:
    api: LiveServer
    tenant: Tenant
    ledger: Ledger
    parsed: threading.Event

    def post(self, content: bytes) -> httpx.Response:
        return httpx.post(
            f"{self.api.base_url}/v1/completions",
            content=content,
            headers={
                "Authorization": f"Bearer {self.tenant.key}",
                "Content-Type": "application/json",
            },
            timeout=WAIT_S * 2,
        )

    def held(self, *, allowed: bool) -> HeldLimiter:
        """Hold the tenants' limiter from now on (the key is in the key cache already)."""
        assert self.api.app is not None
        gate = self.api.app.state.gate
        limiter = HeldLimiter(gate.tenants, allowed)
        gate.tenants = limiter
        return limiter

    def leases(self) -> int:
        snapshot = self.ledger.snapshot(NODE)
        assert snapshot is not None
        return len(snapshot.leases)


BODY = b'{"model": "m", "prompt": [1, 2, 3], "max_tokens": 8}'


@pytest.fixture
def stack(settings: Settings) -> Iterator[Stack]:
    s = api_settings(settings, gateway_bound_admission=False, gateway_max_wait_s=0.0)
    repo = Repository.connect(s.database_url, pool_size=4)
    ledger = Ledger.from_url(s.redis_url, s.redis_namespace, pool_policy(s))
    try:
        repo.upsert_node(NODE, "http://127.0.0.1:9", "m", 256, 16, 0)
        ensure_ledger(repo, ledger, max_preemptions=3)
        tenant = make_tenant(repo, "caller")
        with serve(s) as api:
            assert api.app is not None
            admission = api.app.state.gateway.admission
            parsed = threading.Event()
            parse = admission.parse

            async def parse_seen(*args: Any, **kwargs: Any) -> Any:
                found = await parse(*args, **kwargs)
                parsed.set()
                return found

            admission.parse = parse_seen
            stack = Stack(api, tenant, ledger, parsed)
            # The key's first use goes through Postgres (and the blocking limiter): after it,
            # the key cache knows it, as for every later request of a live tenant.
            assert stack.post(BODY).status_code == 503
            parsed.clear()
            yield stack
    finally:
        ledger.close()
        repo.close()


def test_the_body_is_parsed_while_the_rate_check_is_out_and_a_limited_caller_gets_429(
    stack: Stack,
) -> None:
    limiter = stack.held(allowed=False)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(stack.post, BODY)
        assert limiter.asked.wait(WAIT_S)
        # Before, the edge waited for the bucket before the body was read: nothing was parsed
        # until the answer came.
        assert stack.parsed.wait(WAIT_S), "the request was not parsed while its check was out"
        assert not reply.done()
        limiter.answer.set()
        answer = reply.result(timeout=WAIT_S * 2)
    assert answer.status_code == 429, answer.text
    assert answer.json()["error"]["code"] == "rate_limit_exceeded"
    assert answer.headers["Retry-After"] == "2"
    assert stack.leases() == 0


def test_a_limited_caller_with_a_bad_body_still_gets_the_429(stack: Stack) -> None:
    limiter = stack.held(allowed=False)
    limiter.answer.set()
    for body in (b"{not json", b'{"model": "m"}', b'{"model": "nobody-serves", "prompt": [1]}'):
        answer = stack.post(body)
        assert answer.status_code == 429, answer.text
        assert answer.json()["error"]["code"] == "rate_limit_exceeded"
    assert stack.leases() == 0


def test_an_allowed_caller_is_admitted_once_the_answer_comes(stack: Stack) -> None:
    limiter = stack.held(allowed=True)
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(stack.post, BODY)
        assert stack.parsed.wait(WAIT_S)
        assert stack.leases() == 0  # nothing reserved while the answer is out
        limiter.answer.set()
        answer = reply.result(timeout=WAIT_S * 2)
    # Admitted, then the engine is not there: 503, not a refusal.
    assert answer.status_code == 503, answer.text
