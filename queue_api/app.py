"""The FastAPI application: ``create_app(settings)``; ``backfill api`` serves it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from backfill.capacity_view import UsageSource, ledger_usage
from backfill.config import Settings, get_settings
from backfill.keycache import TenantKeyCache
from backfill.ledger import Ledger
from backfill.ratelimit import RateLimiter
from backfill.repository import Repository
from queue_api import errors, metrics
from queue_api.gateway import InteractiveGateway
from queue_api.routes import batches, capacity, dashboard, files
from queue_api.routes import gateway as gateway_routes
from queue_api.routes import lab as lab_routes

# Room for the multipart envelope around a file of the maximum size.
_MULTIPART_OVERHEAD = 64 * 1024


class UploadSizeGuard:
    """Refuses an upload whose declared length is over the limit before its body is read
    (the form parser would otherwise spool all of it to disk first)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes + _MULTIPART_OVERHEAD

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            for name, value in scope["headers"]:
                if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                    body = errors.error_body(
                        f"request body of {int(value)} bytes is over the upload limit",
                        param="file",
                        code="file_too_large",
                    )
                    await send(
                        {
                            "type": "http.response.start",
                            "status": 413,
                            "headers": [(b"content-type", b"application/json")],
                        }
                    )
                    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
                    return
        await self.app(scope, receive, send)


def create_app(
    settings: Settings | None = None,
    *,
    repository: Repository | None = None,
    usage_source: UsageSource | None = None,
) -> FastAPI:
    """The API over one deployment's Postgres and Redis.

    ``usage_source`` feeds ``/v1/capacity`` with live usage; by default it is the ledger in
    Redis, and nodes the ledger does not know show what Postgres knows.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        repo = repository or Repository.connect(settings.database_url, pool_size=10)
        client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        app.state.settings = settings
        app.state.repository = repo
        app.state.tenant_keys = TenantKeyCache(repo.tenant_for_key, settings.api_key_cache_s)
        app.state.rate_limiter = RateLimiter(
            client, settings.redis_namespace, settings.rate_limit_per_s, settings.rate_limit_burst
        )
        app.state.usage_source = usage_source or ledger_usage(
            Ledger(client, settings.redis_namespace)
        )
        metrics.attach(app, repo, Ledger(client, settings.redis_namespace))
        app.state.gateway = InteractiveGateway(settings, repo)
        try:
            yield
        finally:
            await app.state.gateway.aclose()
            metrics.detach(app)
            client.close()
            if repository is None:
                repo.close()

    app = FastAPI(
        title="Backfill",
        summary="OpenAI-compatible Batch API that backfills batch LLM work into KV-cache slack.",
        version="0.1.0",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(capacity.router)
    gateway_routes.install(app)
    app.include_router(metrics.router)
    dashboard.mount(app)
    app.include_router(lab_routes.router)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        app.state.repository.ping()
        return {"status": "ok"}

    app.add_middleware(UploadSizeGuard, max_bytes=settings.max_file_bytes)
    return app
