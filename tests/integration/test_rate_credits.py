"""Rate credits against the real Redis bucket: a busy tenant's requests mostly pass without a
round trip, the bucket still bounds the tenant over every process, and unspent credits go
back to the bucket."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import redis.asyncio

from backfill.config import Settings
from backfill.config.api import ApiSettings
from backfill.rate_credits import max_take
from backfill.ratelimit import RateLimiter, rate_limit_key
from backfill.redis_client import connect


class CountingRedis(redis.asyncio.Redis):
    """The real asyncio client, counting the commands it sends."""

    sent = 0

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        type(self).sent += 1
        return await super().execute_command(*args, **options)  # type: ignore[no-untyped-call]


def _limiter(settings: Settings, rate: float, burst: int, hold_s: float) -> RateLimiter:
    client = connect(settings.redis_url)
    async_client = CountingRedis.from_url(settings.redis_url)
    return RateLimiter(
        client,
        settings.redis_namespace,
        rate,
        burst,
        async_client=async_client,
        credit_hold_s=hold_s,
    )


def test_a_busy_tenant_is_checked_with_a_fraction_of_the_round_trips(settings: Settings) -> None:
    async def scenario() -> tuple[int, int]:
        counts = []
        for hold_s in (0.0, 5.0):
            CountingRedis.sent = 0
            limiter = _limiter(settings, rate=1000, burst=1000, hold_s=hold_s)
            decisions = [await limiter.acheck(f"busy-{hold_s}") for _ in range(100)]
            assert all(d.allowed for d in decisions)
            counts.append(CountingRedis.sent)
        return counts[0], counts[1]

    without, with_credits = asyncio.run(scenario())
    # One call a request without credits (and one to load the script); with them, asks grow
    # 1, 2, 4, ..., up to a tenth of the burst: about 15 for 100 requests.
    assert without >= 100
    assert with_credits <= 20, with_credits


def test_the_bucket_still_bounds_the_tenant_over_every_process(settings: Settings) -> None:
    burst = 40

    async def scenario() -> int:
        # Four API processes, each with its own credits, one tenant, a bucket that barely
        # refills during the test.
        limiters = [_limiter(settings, rate=0.01, burst=burst, hold_s=5.0) for _ in range(4)]
        allowed = 0
        for _ in range(30):
            for limiter in limiters:
                allowed += (await limiter.acheck("shared")).allowed
        return allowed

    allowed = asyncio.run(scenario())
    assert allowed <= burst + 1, allowed
    # Credits held by one process are not lost to the tenant: every process spends its own
    # before it asks again, so the bucket's whole burst is used.
    assert allowed >= burst - 1, allowed


def test_the_bucket_gives_credits_and_takes_unspent_ones_back(settings: Settings) -> None:
    """The script's side of credits (the book's side is in the unit tests): an allowed
    request takes up to what it asks, never more than the bucket holds; a refund is added
    back first, capped at the burst."""
    key = rate_limit_key(settings.redis_namespace, "slow")
    sync = connect(settings.redis_url)
    limiter = _limiter(settings, rate=0.001, burst=10, hold_s=0.0)
    script = limiter._script  # the script as the limiter registered it

    def call(take: int, refund: int) -> tuple[int, int, int]:
        allowed, wait_ms, taken = script(keys=[key], args=[0.001, 10, 1, take, refund])
        return int(allowed), int(wait_ms), int(taken)

    def tokens() -> float:
        return float(sync.hget(key, "tokens") or 0)

    assert call(take=8, refund=0)[::2] == (1, 8)
    assert round(tokens()) == 2
    assert call(take=8, refund=0)[::2] == (1, 2), "no more than the bucket holds"
    assert round(tokens()) == 0
    assert call(take=8, refund=0)[::2] == (0, 0), "refused: nothing taken"
    assert call(take=1, refund=5)[::2] == (1, 1), "the refund paid for it"
    assert round(tokens()) == 4
    call(take=1, refund=100)
    assert round(tokens()) == 9, "capped at the burst before the request's token"


def test_at_the_default_hold_processes_let_through_at_most_the_bucket_and_what_they_hold(
    settings: Settings,
) -> None:
    """The documented bound: over any stretch, a tenant gets what its bucket allows (burst +
    rate x time) plus the credits its API processes hold, under (max_take - 1) each, whatever
    the hold."""
    rate, burst, processes = 20.0, 100, 3
    hold = ApiSettings().rate_limit_credit_hold_s
    most = max_take(rate, burst, hold)

    async def scenario() -> tuple[int, float]:
        limiters = [_limiter(settings, rate, burst, hold) for _ in range(processes)]
        allowed = 0
        started = time.monotonic()
        for i in range(600):
            allowed += (await limiters[i % processes].acheck("bounded")).allowed
        return allowed, time.monotonic() - started

    allowed, elapsed = asyncio.run(scenario())
    bound = burst + rate * elapsed + processes * (most - 1)
    assert allowed <= bound, (allowed, bound)
    assert allowed >= burst, allowed  # the bucket's burst was all spent
