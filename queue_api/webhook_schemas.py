"""Wire shapes of webhook endpoints (as the openai SDK's ``client.webhooks`` has them) and of
Backfill's delivery log."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from backfill.webhooks.store import DeliveryRecord, EndpointRecord
from queue_api.schemas import CursorList, unix


class CreateWebhookBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str = Field(max_length=4096)
    event_types: list[str] | None = Field(default=None, max_length=64)
    name: str | None = Field(default=None, max_length=1000)


class UpdateWebhookBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str | None = Field(default=None, max_length=4096)
    event_types: list[str] | None = Field(default=None, max_length=64)
    name: str | None = Field(default=None, max_length=1000)
    status: Literal["enabled"] | None = None
    """Backfill's: ``"enabled"`` enables an endpoint disabled for failing (so does a new
    ``url``)."""


class RotateSecretBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    keep_old_secret_active_for_24_hours: bool = False


class WebhookEndpointObject(BaseModel):
    id: str
    object: Literal["webhook_endpoint"] = "webhook_endpoint"
    name: str
    url: str
    event_types: list[str]
    created_at: int
    updated_at: int
    signing_secret_hint: str
    status: Literal["enabled", "disabled"] = "enabled"
    """Backfill's: ``disabled`` after every attempt failed for
    ``BACKFILL_WEBHOOKS_DISABLE_AFTER_S``; nothing is sent until it is enabled again."""
    disabled_reason: str | None = None
    failing_since: int | None = None
    """Backfill's: since when every attempt to it has failed (None: its last was delivered)."""

    @classmethod
    def of(cls, record: EndpointRecord) -> WebhookEndpointObject:
        return cls(
            id=record.id,
            name=record.name,
            url=record.url,
            event_types=record.event_types,
            created_at=int(record.created_at.timestamp()),
            updated_at=int(record.updated_at.timestamp()),
            signing_secret_hint=record.signing_secret_hint,
            status="disabled" if record.disabled_at is not None else "enabled",
            disabled_reason=record.disabled_reason,
            failing_since=(int(record.failing_since.timestamp()) if record.failing_since else None),
        )


class WebhookEndpointWithSecret(WebhookEndpointObject):
    signing_secret: str

    @classmethod
    def with_secret(cls, record: EndpointRecord, secret: str) -> WebhookEndpointWithSecret:
        return cls(**WebhookEndpointObject.of(record).model_dump(), signing_secret=secret)


class WebhookEndpointList(CursorList):
    data: list[WebhookEndpointObject]


class WebhookEndpointDeleted(BaseModel):
    id: str
    object: Literal["webhook_endpoint.deleted"] = "webhook_endpoint.deleted"
    deleted: bool = True


class TestWebhookBody(BaseModel):
    """``POST /v1/webhook_endpoints/{id}/test``: the sample event's type."""

    model_config = ConfigDict(extra="forbid")

    event_type: str = Field(max_length=64)


class WebhookEndpointTestResult(BaseModel):
    """What the endpoint answered to a sample event (OpenAI's ``webhook_endpoint.test``)."""

    object: Literal["webhook_endpoint.test"] = "webhook_endpoint.test"
    webhook_endpoint_id: str
    event_type: str
    status_code: int
    success: Literal[True] = True


class WebhookEventTypeList(BaseModel):
    object: Literal["list"] = "list"
    data: list[str]


class WebhookDeliveryObject(BaseModel):
    """One event's delivery to one endpoint (Backfill's own; ``id`` is its webhook-id)."""

    id: str
    object: Literal["webhook_delivery"] = "webhook_delivery"
    webhook_endpoint_id: str
    event_id: str
    event_type: str
    batch_id: str | None
    """The batch whose end the event says (null for ``webhook_endpoint.disabled``)."""
    subject_id: str
    """The event's ``data.id``: the batch, or the endpoint that was disabled."""
    status: str
    attempts: int
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: int | None
    next_attempt_at: int | None
    delivered_at: int | None
    failed_at: int | None
    created_at: int

    @classmethod
    def of(cls, record: DeliveryRecord) -> WebhookDeliveryObject:
        return cls(
            id=record.webhook_id,
            webhook_endpoint_id=record.endpoint_id,
            event_id=record.event_id,
            event_type=record.event_type,
            batch_id=record.batch_id,
            subject_id=record.subject_id,
            status=record.state.value,
            attempts=record.attempts,
            last_status_code=record.last_status_code,
            last_error=record.last_error,
            last_attempt_at=unix(record.last_attempt_at),
            next_attempt_at=unix(record.next_attempt_at),
            delivered_at=unix(record.delivered_at),
            failed_at=unix(record.failed_at),
            created_at=int(record.created_at.timestamp()),
        )


class WebhookDeliveryList(CursorList):
    data: list[WebhookDeliveryObject]
