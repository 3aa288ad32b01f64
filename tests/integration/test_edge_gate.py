"""The edge's gate on the event loop: a key the key cache knows is authenticated and its
tenant's rate limit checked through the asyncio Redis client, with no worker thread and no
Postgres; a key it does not know goes the blocking way (``Gate.authenticate`` in a thread),
which fills the cache."""

from __future__ import annotations

import asyncio

import pytest

from backfill.config import Settings
from backfill.keycache import TenantKeyCache
from backfill.ratelimit import RateLimiter
from backfill.redis_client import connect, connect_async
from backfill.refusals import RateLimited
from backfill.store import Repository, TenantRecord
from queue_api.edge import Gate
from queue_api.errors import Unauthorized
from tests.integration.batch_api_support import make_tenant


def test_a_cached_key_is_checked_on_the_loop_and_an_unknown_one_is_left_to_the_thread(
    settings: Settings, repo: Repository
) -> None:
    tenant = make_tenant(repo, "acme")
    lookups: list[str] = []

    def lookup(key: str) -> TenantRecord | None:
        lookups.append(key)
        return repo.tenants.tenant_for_key(key)

    async def scenario() -> None:
        client = connect(settings.redis_url)
        async_client = connect_async(settings.redis_url)
        ns = settings.redis_namespace
        gate = Gate(
            TenantKeyCache(lookup, 60),
            RateLimiter(client, ns, 0.001, 3, async_client=async_client),
            RateLimiter(client, ns, 100, 100),
        )
        try:
            bearer = f"Bearer {tenant.key}"
            # Not cached yet: the loop leaves it to the blocking way, which asks Postgres.
            assert await gate.authenticate_cached(bearer) is None
            assert lookups == []
            assert gate.authenticate(bearer, "127.0.0.1").id == tenant.id
            assert lookups == [tenant.key]
            # Cached: on the loop, no lookup, the same bucket (3 in a burst, 1 used above).
            for _ in range(2):
                found = await gate.authenticate_cached(bearer)
                assert found is not None
                assert found.id == tenant.id
            with pytest.raises(RateLimited):
                await gate.authenticate_cached(bearer)
            assert lookups == [tenant.key]
            # A key that matched nothing, once cached, is refused on the loop too.
            with pytest.raises(Unauthorized):
                gate.authenticate("Bearer sk-nobody", "127.0.0.1")
            with pytest.raises(Unauthorized):
                await gate.authenticate_cached("Bearer sk-nobody")
            with pytest.raises(Unauthorized):
                await gate.authenticate_cached("Basic abc")
        finally:
            client.close()
            await async_client.aclose()

    asyncio.run(scenario())
