"""Dependencies every route takes: settings, the repository, and the calling tenant."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import Depends, Request

from backfill.capacity_view import UsageSource
from backfill.config import Settings
from backfill.keycache import TenantKeyCache
from backfill.ratelimit import RateLimiter
from backfill.refusals import RateLimited
from backfill.repository import Repository, TenantRecord
from queue_api.errors import Unauthorized


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_repository(request: Request) -> Repository:
    repo: Repository = request.app.state.repository
    return repo


async def get_rate_limiter(request: Request) -> RateLimiter:
    limiter: RateLimiter = request.app.state.rate_limiter
    return limiter


async def get_usage_source(request: Request) -> UsageSource | None:
    source: UsageSource | None = request.app.state.usage_source
    return source


SettingsDep = Annotated[Settings, Depends(get_settings)]
RepositoryDep = Annotated[Repository, Depends(get_repository)]
RateLimiterDep = Annotated[RateLimiter, Depends(get_rate_limiter)]
UsageSourceDep = Annotated[UsageSource | None, Depends(get_usage_source)]


async def get_tenant_keys(request: Request) -> TenantKeyCache:
    keys: TenantKeyCache = request.app.state.tenant_keys
    return keys


TenantKeysDep = Annotated[TenantKeyCache, Depends(get_tenant_keys)]


async def current_tenant(
    request: Request, keys: TenantKeysDep, limiter: RateLimiterDep
) -> TenantRecord:
    """The tenant of the ``Authorization: Bearer`` key, once its rate limit allows.

    The key lookup (Postgres on a cache miss) and the rate limit (Redis) block, so they run
    together in one worker thread: one hop off the event loop per request, not one per
    dependency (the getters above are ``async`` for that reason: they only read app state)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        )
    return await anyio.to_thread.run_sync(_authenticate, key, keys, limiter)


def _authenticate(key: str, keys: TenantKeyCache, limiter: RateLimiter) -> TenantRecord:
    tenant = keys.get(key)
    if tenant is None:
        raise Unauthorized("Incorrect API key provided.")
    decision = limiter.check(tenant.id)
    if not decision.allowed:
        raise RateLimited(
            "Too many requests for this tenant; retry after the time in Retry-After.",
            retry_after_s=decision.retry_after_s,
        )
    return tenant


TenantDep = Annotated[TenantRecord, Depends(current_tenant)]
