"""Adding and changing a tenant's endpoints: what is checked before anything is stored."""

from __future__ import annotations

import time
from dataclasses import dataclass

from backfill.config import Settings
from backfill.refusals import InvalidRequest
from backfill.webhooks.delivery import Poster
from backfill.webhooks.events import (
    ALL_EVENT_TYPES,
    new_event_id,
    new_webhook_id,
    parse_event_types,
)
from backfill.webhooks.outbox import ClaimedDelivery
from backfill.webhooks.store import EndpointRecord, WebhookStore
from backfill.webhooks.targets import Resolver, TargetRefused, check_target, system_resolver

MAX_NAME_CHARS = 200

KEEP_OLD_SECRET_S = 24 * 3600.0
"""How long a rotated-out secret keeps signing when the caller asks to keep it."""


def _event_types(values: list[str] | None) -> list[str]:
    try:
        return parse_event_types(values)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="event_types") from None


def _url(url: str, settings: Settings, resolve: Resolver) -> str:
    try:
        check_target(url, allow_private=settings.webhooks_allow_private, resolve=resolve)
    except TargetRefused as exc:
        raise InvalidRequest(str(exc), param="url", code="invalid_webhook_url") from None
    return url


def _name(name: str | None, url: str) -> str:
    name = (name or "").strip() or url[:MAX_NAME_CHARS]
    if len(name) > MAX_NAME_CHARS:
        raise InvalidRequest(f"name is longer than {MAX_NAME_CHARS} characters", param="name")
    return name


def add_endpoint(
    store: WebhookStore,
    settings: Settings,
    tenant_id: str,
    *,
    url: str,
    event_types: list[str] | None = None,
    name: str | None = None,
    resolve: Resolver = system_resolver,
) -> tuple[EndpointRecord, str]:
    """A checked endpoint and its secret (shown once): all batch events when none named."""
    # The cheap checks first; the URL's costs a DNS lookup.
    wanted = _event_types(event_types)
    named = _name(name, url)
    return store.create_endpoint(
        tenant_id,
        name=named,
        url=_url(url, settings, resolve),
        event_types=wanted,
        limit=settings.webhooks_max_endpoints,
    )


def update_endpoint(
    store: WebhookStore,
    settings: Settings,
    tenant_id: str,
    endpoint_id: str,
    *,
    url: str | None = None,
    event_types: list[str] | None = None,
    name: str | None = None,
    enable: bool = False,
    resolve: Resolver = system_resolver,
) -> EndpointRecord:
    """Change what is given; ``enable`` (or a new URL) enables an endpoint disabled for
    failing."""
    wanted = None if event_types is None else _event_types(event_types)
    named = None if name is None else _name(name, url or "")
    return store.update_endpoint(
        tenant_id,
        endpoint_id,
        name=named,
        url=None if url is None else _url(url, settings, resolve),
        event_types=wanted,
        enable=enable,
    )


@dataclass(frozen=True, slots=True)
class SampleSent:
    """What came of a sample event sent to an endpoint."""

    event_type: str
    status_code: int


class SampleNotDelivered(InvalidRequest):
    """The sample event reached no answer (refused target, no connection, no answer in
    time)."""

    default_code = "webhook_test_failed"


def send_test_event(
    store: WebhookStore, poster: Poster, tenant_id: str, endpoint_id: str, event_type: str
) -> SampleSent:
    """Send one sample event of ``event_type`` to one of the tenant's endpoints now, signed
    as a real delivery is (its ``data.id`` names no batch), and say what the endpoint
    answered. Nothing is recorded: it is not a delivery."""
    if event_type not in ALL_EVENT_TYPES:
        raise InvalidRequest(
            f"event_type {event_type!r} is not one Backfill sends; it sends "
            + ", ".join(ALL_EVENT_TYPES),
            param="event_type",
        )
    url, secrets = store.endpoint_target(tenant_id, endpoint_id)
    sample = ClaimedDelivery(
        delivery_id=0,
        attempt=1,
        webhook_id=new_webhook_id(),
        event_id=new_event_id(),
        event_type=event_type,
        subject_id="batch_test" if event_type.startswith("batch.") else "we_test",
        event_created_at=int(time.time()),
        age_s=0.0,
        url=url,
        secrets=secrets,
    )
    result = poster.post(sample)
    if result.status_code is None:
        raise SampleNotDelivered(
            f"the sample event was not delivered to {url}: {result.error}", param="url"
        )
    return SampleSent(event_type, result.status_code)
