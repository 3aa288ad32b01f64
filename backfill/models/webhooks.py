"""The webhooks' tables (``backfill.webhooks``): a tenant's endpoints, the outbox of batch
events, and each event's delivery to each endpoint."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column

from backfill.models.base import TZ, Base


class WebhookEndpoint(Base):
    """A tenant's URL that hears of its batches' ends (``backfill.webhooks``)."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    url: Mapped[str] = mapped_column(String(2048))
    event_types: Mapped[list[str]] = mapped_column(ARRAY(String(32)))
    # The signing secret (the HMAC key must be at hand to sign: sealed under the deployment's
    # keys, ``backfill.webhooks.sealing``, or in clear where none is set); a rotated-out
    # secret keeps signing beside the new one until ``previous_secret_until``.
    secret: Mapped[str] = mapped_column(Text)
    previous_secret: Mapped[str | None] = mapped_column(Text)
    previous_secret_until: Mapped[datetime | None] = mapped_column(TZ)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    updated_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    # Since when every attempt to it has failed (NULL: its last one was delivered); past
    # BACKFILL_WEBHOOKS_DISABLE_AFTER_S of that it is disabled, with the last error as reason.
    failing_since: Mapped[datetime | None] = mapped_column(TZ)
    disabled_at: Mapped[datetime | None] = mapped_column(TZ)
    disabled_reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (Index("ix_webhook_endpoints_tenant_created", "tenant_id", "created_at"),)


class WebhookEvent(Base):
    """The outbox: one row per batch end that some endpoint wants, written in the
    transaction that ended the batch; or per endpoint disabled (``subject_id``: the
    endpoint), written in the transaction that disabled it, kept for the retention period."""

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    job_id: Mapped[str | None] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    subject_id: Mapped[str | None] = mapped_column(String(40))
    type: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        CheckConstraint("job_id IS NOT NULL OR subject_id IS NOT NULL", name="subject"),
        Index("ix_webhook_events_job", "job_id"),
        Index(
            "ix_webhook_events_unowned_created",
            "created_at",
            postgresql_where=text("job_id IS NULL"),
        ),
    )


class WebhookDelivery(Base):
    """One event's delivery to one endpoint: its ``webhook-id`` (the same on every attempt),
    where it stands, and its last attempt (the delivery log)."""

    __tablename__ = "webhook_deliveries"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id", ondelete="CASCADE"))
    endpoint_id: Mapped[str] = mapped_column(ForeignKey("webhook_endpoints.id", ondelete="CASCADE"))
    tenant_id: Mapped[str] = mapped_column(String(40))
    webhook_id: Mapped[str] = mapped_column(String(40), unique=True)
    state: Mapped[str] = mapped_column(String(16), server_default="pending")
    attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # Due from then; while a sender holds it, the end of the sender's lease.
    next_attempt_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())
    last_attempt_at: Mapped[datetime | None] = mapped_column(TZ)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    delivered_at: Mapped[datetime | None] = mapped_column(TZ)
    failed_at: Mapped[datetime | None] = mapped_column(TZ)
    created_at: Mapped[datetime] = mapped_column(TZ, server_default=func.now())

    __table_args__ = (
        CheckConstraint("state IN ('delivered', 'failed', 'pending')", name="state"),
        UniqueConstraint("event_id", "endpoint_id"),
        Index(
            "ix_webhook_deliveries_due",
            "next_attempt_at",
            postgresql_where=text("state = 'pending'"),
        ),
        Index("ix_webhook_deliveries_endpoint", "endpoint_id", "id"),
        # The sender's claim: each endpoint's due deliveries, oldest first.
        Index(
            "ix_webhook_deliveries_endpoint_due",
            "endpoint_id",
            "next_attempt_at",
            postgresql_where=text("state = 'pending'"),
        ),
        Index("ix_webhook_deliveries_tenant", "tenant_id", "id"),
    )
