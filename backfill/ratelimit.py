"""Per-tenant request rate limits: a token bucket in Redis, changed only by one Lua script.

Redis trouble lets requests through (fail open): the rate limit protects the service from one
tenant's burst, and refusing every tenant because Redis blinked would be the worse outage.

On the event loop (:meth:`RateLimiter.acheck`, the API's path for a known key) a busy tenant's
requests are paid from rate credits (:mod:`backfill.rate_credits`) when ``credit_hold_s`` is
set: a few tokens taken at once, so most requests cost no round trip to Redis.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from backfill.rate_credits import Ask, CreditBook, max_take
from backfill.redis_client import AsyncRedis, SyncRedis

log = logging.getLogger(__name__)

_SCRIPT = (resources.files("backfill") / "lua" / "rate_limit.lua").read_text()


def rate_limit_key(namespace: str, tenant_id: str) -> str:
    """The bucket of one tenant (under the namespace, so ``{ns}:*`` finds it)."""
    return f"{namespace}:ratelimit:{tenant_id}"


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float = 0.0


class RateLimiter:
    """One bucket per tenant: ``rate_per_s`` sustained, ``burst`` at once."""

    def __init__(
        self,
        client: SyncRedis,
        namespace: str,
        rate_per_s: float,
        burst: int,
        *,
        async_client: AsyncRedis | None = None,
        credit_hold_s: float = 0.0,
    ) -> None:
        """``credit_hold_s`` (> 0, with ``async_client``): :meth:`acheck` spends rate credits
        held at most that long; 0 asks the bucket on every request."""
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self._client = client
        self._namespace = namespace
        self._rate = rate_per_s
        self._burst = burst
        self._script: Any = client.register_script(_SCRIPT)
        self._async_script: Any = (
            async_client.register_script(_SCRIPT) if async_client is not None else None
        )
        self._credits = (
            CreditBook(max_take(rate_per_s, burst, credit_hold_s), credit_hold_s)
            if credit_hold_s > 0
            else None
        )

    @property
    def checks_async(self) -> bool:
        """Whether :meth:`acheck` can run (an asyncio client was given)."""
        return self._async_script is not None

    def check(self, tenant_id: str, cost: int = 1) -> RateDecision:
        """Whether ``tenant_id`` may spend ``cost`` tokens now (a cost over the burst costs
        the burst: a full bucket always lets a request through)."""
        cost = min(cost, self._burst)
        try:
            allowed, wait_ms, _ = self._script(keys=self._keys(tenant_id), args=self._args(cost))
        except redis.RedisError as exc:
            log.warning("rate limit not checked (Redis: %s); letting the request through", exc)
            return RateDecision(True)
        return _decision(allowed, wait_ms)

    async def acheck(self, tenant_id: str, cost: int = 1) -> RateDecision:
        """:meth:`check` on the event loop, through the asyncio client."""
        if self._async_script is None:
            raise RuntimeError("this rate limiter was built without an asyncio client")
        cost = min(cost, self._burst)
        book = self._credits
        now = time.monotonic()
        if book is not None and book.spend(tenant_id, cost, now):
            return RateDecision(True)
        ask = book.ask(tenant_id, cost, now) if book is not None else Ask(cost, 0)
        try:
            allowed, wait_ms, taken = await self._async_script(
                keys=self._keys(tenant_id), args=[*self._args(cost), ask.take, ask.refund]
            )
        except redis.RedisError as exc:
            log.warning("rate limit not checked (Redis: %s); letting the request through", exc)
            return RateDecision(True)
        if book is not None:
            book.got(tenant_id, ask, int(taken), cost, now)
        return _decision(allowed, wait_ms)

    def _keys(self, tenant_id: str) -> list[str]:
        return [rate_limit_key(self._namespace, tenant_id)]

    def _args(self, cost: int) -> list[float]:
        return [self._rate, self._burst, cost]


def _decision(allowed: Any, wait_ms: Any) -> RateDecision:
    if int(allowed):
        return RateDecision(True)
    return RateDecision(False, max(int(wait_ms), 1) / 1000)
