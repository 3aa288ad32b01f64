"""The FastAPI application: ``create_app(settings)``; ``backfill api`` serves it."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI

from backfill.capacity_view import UsageSource, ledger_usage
from backfill.config import Settings, get_settings
from backfill.engine.local_tokenizer import LocalCounts
from backfill.ingest_slots import IngestSlots
from backfill.keycache import RevocationListener, TenantKeyCache
from backfill.ledger import Ledger
from backfill.redis_client import connect, connect_async
from backfill.store import Repository
from backfill.webhooks.sealing import CLEAR_SECRETS_WARNING, SecretSeal
from backfill.webhooks.store import WebhookStore
from queue_api import errors, metrics
from queue_api.edge import RequestEdge, build_gate
from queue_api.gateway import InteractiveGateway
from queue_api.ingest_processes import IngestProcesses
from queue_api.routes import batches, capacity, dashboard, files, summaries, webhooks
from queue_api.routes import gateway as gateway_routes
from queue_api.routes import lab as lab_routes

log = logging.getLogger("backfill.api")


def _deferred_creates_wait(repo: Repository) -> bool:
    """Whether deferred creates wait for an ingest (False if Postgres does not answer, or its
    schema is not migrated yet: the API still starts, and its first deferred create starts
    the ingest processes)."""
    try:
        return repo.ingest_queue.ingest_backlog()[0] > 0
    except Exception as exc:  # the driver and SQLAlchemy raise many types; none stops the API
        log.warning("could not look for deferred creates at start-up: %s", exc)
        return False


def _install_routes(app: FastAPI) -> None:
    """The error handlers, every router, the gateway and the dashboard."""
    errors.install(app)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(summaries.router)
    app.include_router(capacity.router)
    app.include_router(webhooks.router)
    gateway_routes.install(app)
    app.include_router(metrics.router)
    dashboard.mount(app)
    app.include_router(lab_routes.router)


def create_app(
    settings: Settings | None = None,
    *,
    repository: Repository | None = None,
    usage_source: UsageSource | None = None,
    eager_ingesters: bool = False,
) -> FastAPI:
    """The API over one deployment's Postgres and Redis.

    ``usage_source`` feeds ``/v1/capacity`` with live usage; by default it is the ledger in
    Redis, and nodes the ledger does not know show what Postgres knows. The API's ingest
    processes start with it when ``eager_ingesters`` (``backfill api``: ready for the first
    large create), else at its first deferred create or if deferred creates wait.
    """
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        repo = repository or Repository.connect(settings.database_url, pool_size=10)
        client = connect(settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        app.state.settings = settings
        app.state.repository = repo
        seal = SecretSeal(settings.webhooks_seal_keys)
        if not seal.sealing:
            log.warning(CLEAR_SECRETS_WARNING)
        app.state.webhooks = WebhookStore(repo.engine, seal)
        app.state.ingest_slots = IngestSlots(settings.max_ingests_per_tenant, settings.max_ingests)
        app.state.document_counts = anyio.CapacityLimiter(summaries.COUNTS_IN_FLIGHT)
        app.state.local_counts = LocalCounts()  # the engines' tokenizer files, checked
        ingesters = IngestProcesses(settings, settings.ingesters)
        app.state.ingesters = ingesters
        if settings.ingesters and (eager_ingesters or _deferred_creates_wait(repo)):
            ingesters.ensure_started()
        keys = TenantKeyCache(repo.tenants.tenant_for_key, settings.api_key_cache_s)
        namespace = settings.redis_namespace
        # The tenants' limit is checked on the event loop for keys the cache knows.
        async_client = connect_async(
            settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        app.state.gate = build_gate(settings, keys, client, async_client)
        # Its own connection: a subscribed connection can do nothing else.
        subscriber = connect(settings.redis_url, socket_connect_timeout=0.5)
        revocations = RevocationListener(subscriber, namespace, keys).start()
        app.state.revocations = revocations
        app.state.usage_source = usage_source or ledger_usage(Ledger(client, namespace))
        metrics.attach(app, repo, Ledger(client, namespace), settings.metrics_cache_s)
        lab_routes.install_limiter(app)
        app.state.gateway = InteractiveGateway(settings, repo)
        try:
            yield
        finally:
            ingesters.stop()
            await app.state.gateway.aclose()
            metrics.detach(app)
            revocations.stop()
            subscriber.close()
            client.close()
            await async_client.aclose()
            if repository is None:
                repo.close()

    app = FastAPI(
        title="Backfill",
        summary="OpenAI-compatible Batch API that backfills batch LLM work into KV-cache slack.",
        version="0.1.0",
        lifespan=lifespan,
    )
    _install_routes(app)

    @app.get("/healthz", tags=["health"])
    def healthz() -> dict[str, Any]:
        app.state.repository.ping()
        # Whether large creates are being ingested by a process of this API's (false until
        # its first deferred create, unless ``backfill api`` started them with it).
        return {"status": "ok", "ingest_ready": app.state.ingesters.ready}

    app.add_middleware(RequestEdge, settings=settings)
    return app


def served_app() -> FastAPI:
    """The app ``backfill api`` serves: its ingest processes start with it."""
    return create_app(eager_ingesters=True)
