"""Dependencies every route takes: settings, the repository, and the calling tenant."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import anyio
from fastapi import Depends, Request

from backfill.capacity_view import UsageSource
from backfill.config import Settings
from backfill.ingest_slots import IngestSlots
from backfill.store import Repository, TenantRecord
from backfill.webhooks.store import WebhookStore
from queue_api.edge import TENANT_STATE, Gate, client_address
from queue_api.ingest_processes import IngestProcesses


def _app_state(name: str) -> Callable[[Request], Awaitable[Any]]:
    """A dependency answering ``request.app.state.<name>`` (what the app was built with); the
    route's ``Annotated`` type says what it is."""

    async def read(request: Request) -> Any:
        return getattr(request.app.state, name)

    return read


get_settings = _app_state("settings")
get_repository = _app_state("repository")
get_webhook_store = _app_state("webhooks")
get_usage_source = _app_state("usage_source")
get_ingest_slots = _app_state("ingest_slots")
get_ingesters = _app_state("ingesters")
get_gate = _app_state("gate")


SettingsDep = Annotated[Settings, Depends(get_settings)]
IngestersDep = Annotated[IngestProcesses, Depends(get_ingesters)]
IngestSlotsDep = Annotated[IngestSlots, Depends(get_ingest_slots)]
RepositoryDep = Annotated[Repository, Depends(get_repository)]
WebhookStoreDep = Annotated[WebhookStore, Depends(get_webhook_store)]
UsageSourceDep = Annotated[UsageSource | None, Depends(get_usage_source)]
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
