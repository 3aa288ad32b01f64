"""Dependencies every route takes: settings, the repository, and the calling tenant."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import Depends, Request

from backfill.capacity_view import UsageSource
from backfill.config import Settings
from backfill.ingest_slots import IngestSlots
from backfill.store import Repository, TenantRecord
from backfill.webhooks.store import WebhookStore
from queue_api.edge import TENANT_STATE, Gate, client_address
from queue_api.ingest_processes import IngestProcesses


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_repository(request: Request) -> Repository:
    repo: Repository = request.app.state.repository
    return repo


async def get_webhook_store(request: Request) -> WebhookStore:
    store: WebhookStore = request.app.state.webhooks
    return store


async def get_usage_source(request: Request) -> UsageSource | None:
    source: UsageSource | None = request.app.state.usage_source
    return source


async def get_ingest_slots(request: Request) -> IngestSlots:
    slots: IngestSlots = request.app.state.ingest_slots
    return slots


async def get_ingesters(request: Request) -> IngestProcesses:
    ingesters: IngestProcesses = request.app.state.ingesters
    return ingesters


SettingsDep = Annotated[Settings, Depends(get_settings)]
IngestersDep = Annotated[IngestProcesses, Depends(get_ingesters)]
IngestSlotsDep = Annotated[IngestSlots, Depends(get_ingest_slots)]
RepositoryDep = Annotated[Repository, Depends(get_repository)]
WebhookStoreDep = Annotated[WebhookStore, Depends(get_webhook_store)]
UsageSourceDep = Annotated[UsageSource | None, Depends(get_usage_source)]


async def get_gate(request: Request) -> Gate:
    gate: Gate = request.app.state.gate
    return gate


GateDep = Annotated[Gate, Depends(get_gate)]


async def current_tenant(request: Request, gate: GateDep) -> TenantRecord:
    """The tenant of the ``Authorization: Bearer`` key, once its rate limit allows.

    The request edge (``queue_api.edge``) has checked both before the body was read and left
    the tenant in the request's state; a route the edge did not cover checks here, in one
    worker thread (the key lookup and the rate limit block: one hop off the event loop per
    request, and the getters above are ``async`` because they only read app state)."""
    tenant: TenantRecord | None = request.scope.get("state", {}).get(TENANT_STATE)
    if tenant is not None:
        return tenant
    return await anyio.to_thread.run_sync(
        gate.authenticate,
        request.headers.get("authorization", ""),
        client_address(request.scope),
    )


TenantDep = Annotated[TenantRecord, Depends(current_tenant)]
