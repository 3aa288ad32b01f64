"""``/v1/webhook_endpoints`` (as the openai SDK's ``client.webhooks`` calls them) and
``/v1/webhook_deliveries``, Backfill's delivery log."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from backfill.webhooks import endpoints
from backfill.webhooks.delivery import Poster
from backfill.webhooks.events import ALL_EVENT_TYPES
from queue_api.deps import IngestSlotsDep, SettingsDep, TenantDep, WebhookStoreDep
from queue_api.webhook_schemas import (
    CreateWebhookBody,
    RotateSecretBody,
    TestWebhookBody,
    UpdateWebhookBody,
    WebhookDeliveryList,
    WebhookDeliveryObject,
    WebhookEndpointDeleted,
    WebhookEndpointList,
    WebhookEndpointObject,
    WebhookEndpointTestResult,
    WebhookEndpointWithSecret,
    WebhookEventTypeList,
)

router = APIRouter(prefix="/v1", tags=["webhooks"])

Limit = Annotated[int, Query(ge=1, le=100)]


@router.post("/webhook_endpoints")
def create_endpoint(
    body: CreateWebhookBody, tenant: TenantDep, store: WebhookStoreDep, settings: SettingsDep
) -> WebhookEndpointWithSecret:
    record, secret = endpoints.add_endpoint(
        store, settings, tenant.id, url=body.url, event_types=body.event_types, name=body.name
    )
    return WebhookEndpointWithSecret.with_secret(record, secret)


@router.get("/webhook_endpoints")
def list_endpoints(
    tenant: TenantDep, store: WebhookStoreDep, after: str | None = None, limit: Limit = 20
) -> WebhookEndpointList:
    records = store.endpoints(tenant.id, after=after, limit=limit + 1)
    data = [WebhookEndpointObject.of(r) for r in records[:limit]]
    return WebhookEndpointList.page(data, len(records) > limit)


@router.get("/webhook_endpoints/{endpoint_id}")
def retrieve_endpoint(
    endpoint_id: str, tenant: TenantDep, store: WebhookStoreDep
) -> WebhookEndpointObject:
    return WebhookEndpointObject.of(store.endpoint(tenant.id, endpoint_id))


@router.post("/webhook_endpoints/{endpoint_id}")
def update_endpoint(
    endpoint_id: str,
    body: UpdateWebhookBody,
    tenant: TenantDep,
    store: WebhookStoreDep,
    settings: SettingsDep,
) -> WebhookEndpointObject:
    record = endpoints.update_endpoint(
        store,
        settings,
        tenant.id,
        endpoint_id,
        url=body.url,
        event_types=body.event_types,
        name=body.name,
        enable=body.status == "enabled",
    )
    return WebhookEndpointObject.of(record)


@router.delete("/webhook_endpoints/{endpoint_id}")
def delete_endpoint(
    endpoint_id: str, tenant: TenantDep, store: WebhookStoreDep
) -> WebhookEndpointDeleted:
    store.delete_endpoint(tenant.id, endpoint_id)
    return WebhookEndpointDeleted(id=endpoint_id)


@router.post("/webhook_endpoints/{endpoint_id}/rotate_secret")
def rotate_secret(
    endpoint_id: str,
    tenant: TenantDep,
    store: WebhookStoreDep,
    body: RotateSecretBody | None = None,
) -> WebhookEndpointWithSecret:
    keep = body is not None and body.keep_old_secret_active_for_24_hours
    record, secret = store.rotate_secret(
        tenant.id, endpoint_id, keep_old_for_s=endpoints.KEEP_OLD_SECRET_S if keep else 0.0
    )
    return WebhookEndpointWithSecret.with_secret(record, secret)


@router.post("/webhook_endpoints/{endpoint_id}/test")
def send_test_event(
    endpoint_id: str,
    body: TestWebhookBody,
    tenant: TenantDep,
    store: WebhookStoreDep,
    settings: SettingsDep,
    slots: IngestSlotsDep,
) -> WebhookEndpointTestResult:
    """Send a sample event to the endpoint now, signed as a delivery is, and answer with the
    status it returned. It holds one of the tenant's slots for slow work while it waits (at
    most ``webhooks_timeout_s``)."""
    with slots.held(tenant.id):
        poster = Poster(settings)
        try:
            sent = endpoints.send_test_event(store, poster, tenant.id, endpoint_id, body.event_type)
        finally:
            poster.close()
    return WebhookEndpointTestResult(
        webhook_endpoint_id=endpoint_id, event_type=sent.event_type, status_code=sent.status_code
    )


@router.get("/webhook_event_types")
def event_types(_: TenantDep) -> WebhookEventTypeList:
    return WebhookEventTypeList(data=list(ALL_EVENT_TYPES))


@router.get("/webhook_deliveries")
def list_deliveries(
    tenant: TenantDep,
    store: WebhookStoreDep,
    webhook_endpoint_id: str | None = None,
    batch_id: str | None = None,
    after: str | None = None,
    limit: Limit = 20,
) -> WebhookDeliveryList:
    """The delivery log, newest first: each event's delivery to each endpoint, its attempts
    and the last one's answer, and when the next is due."""
    if webhook_endpoint_id is not None:
        store.endpoint(tenant.id, webhook_endpoint_id)  # 404 for an endpoint not the tenant's
    records = store.deliveries(
        tenant.id,
        endpoint_id=webhook_endpoint_id,
        batch_id=batch_id,
        after=after,
        limit=limit + 1,
    )
    data = [WebhookDeliveryObject.of(r) for r in records[:limit]]
    return WebhookDeliveryList.page(data, len(records) > limit)
