"""Per-tenant request rate limits: a token bucket in Redis, changed only by one Lua script.

Redis trouble lets requests through (fail open): the rate limit protects the service from one
tenant's burst, and refusing every tenant because Redis blinked would be the worse outage.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from backfill.redis_client import SyncRedis

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

    def __init__(self, client: SyncRedis, namespace: str, rate_per_s: float, burst: int) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self._client = client
        self._namespace = namespace
        self._rate = rate_per_s
        self._burst = burst
        self._script: Any = client.register_script(_SCRIPT)

    def check(self, tenant_id: str, cost: int = 1) -> RateDecision:
        try:
            allowed, wait_ms = self._script(
                keys=[rate_limit_key(self._namespace, tenant_id)],
                args=[self._rate, self._burst, cost],
            )
        except redis.RedisError as exc:
            log.warning("rate limit not checked (Redis: %s); letting the request through", exc)
            return RateDecision(True)
        if int(allowed):
            return RateDecision(True)
        return RateDecision(False, max(int(wait_ms), 1) / 1000)
