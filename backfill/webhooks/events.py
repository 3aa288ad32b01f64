"""Batch events as OpenAI sends them: which job state is which event, and the exact bytes;
and Backfill's one event of its own, sent only to endpoints that name it.

The body is rebuilt from the stored event (id, type, time, batch) on every attempt, so every
retry carries the same bytes; ``openai.types.webhooks.BatchCompletedWebhookEvent`` and its
siblings are the shape.
"""

from __future__ import annotations

import json
import secrets
from enum import StrEnum

from backfill.states import JobState


class EventType(StrEnum):
    """The events a Backfill endpoint can subscribe to (OpenAI's batch events)."""

    BATCH_COMPLETED = "batch.completed"
    """The batch finished; its output and error files are ready."""
    BATCH_FAILED = "batch.failed"
    """The batch could not run (its ``errors`` say why)."""
    BATCH_EXPIRED = "batch.expired"
    """The deadline passed; finished results are kept."""
    BATCH_CANCELLED = "batch.cancelled"
    """The batch was cancelled; finished results are kept."""
    WEBHOOK_ENDPOINT_DISABLED = "webhook_endpoint.disabled"
    """One of the tenant's endpoints was disabled for failing too long (``data.id``: it;
    its ``disabled_reason`` says why). Backfill's own: in no endpoint's default types."""


EVENT_OF_STATE: dict[JobState, EventType] = {
    JobState.COMPLETED: EventType.BATCH_COMPLETED,
    JobState.FAILED: EventType.BATCH_FAILED,
    JobState.EXPIRED: EventType.BATCH_EXPIRED,
    JobState.CANCELLED: EventType.BATCH_CANCELLED,
}
"""The job states that send an event: the terminal ones, each once (nothing leaves them)."""

ALL_EVENT_TYPES: tuple[str, ...] = tuple(t.value for t in EventType)

DEFAULT_EVENT_TYPES: tuple[str, ...] = tuple(t.value for t in EVENT_OF_STATE.values())
"""What an endpoint that names no types gets: OpenAI's batch events. Backfill's own event
only by name, so a receiver that accepts every type its OpenAI SDK knows never meets it."""


def new_event_id() -> str:
    return f"evt_{secrets.token_hex(16)}"


def new_webhook_id() -> str:
    """The ``webhook-id`` of one event's delivery to one endpoint, kept on every attempt."""
    return f"wh_{secrets.token_hex(16)}"


def event_body(event_id: str, event_type: str, created_at: int, subject_id: str) -> bytes:
    """The JSON an endpoint receives (and the bytes that are signed); ``subject_id``: the
    batch, or the endpoint of ``webhook_endpoint.disabled``."""
    event = {
        "id": event_id,
        "object": "event",
        "type": event_type,
        "created_at": created_at,
        "data": {"id": subject_id},
    }
    return json.dumps(event, separators=(",", ":")).encode()


def parse_event_types(values: list[str] | None) -> list[str]:
    """The event types an endpoint asked for, deduplicated in canonical order; the batch
    events (:data:`DEFAULT_EVENT_TYPES`) when none were named. ``ValueError`` names the first
    unknown one."""
    if not values:
        return list(DEFAULT_EVENT_TYPES)
    unknown = [v for v in values if v not in ALL_EVENT_TYPES]
    if unknown:
        raise ValueError(
            f"unknown event type {unknown[0]!r}; Backfill sends {', '.join(ALL_EVENT_TYPES)}"
        )
    return [t for t in ALL_EVENT_TYPES if t in values]
