"""Batch events as OpenAI sends them: which job state is which event, and the exact bytes.

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


EVENT_OF_STATE: dict[JobState, EventType] = {
    JobState.COMPLETED: EventType.BATCH_COMPLETED,
    JobState.FAILED: EventType.BATCH_FAILED,
    JobState.EXPIRED: EventType.BATCH_EXPIRED,
    JobState.CANCELLED: EventType.BATCH_CANCELLED,
}
"""The job states that send an event: the terminal ones, each once (nothing leaves them)."""

ALL_EVENT_TYPES: tuple[str, ...] = tuple(t.value for t in EventType)


def new_event_id() -> str:
    return f"evt_{secrets.token_hex(16)}"


def new_webhook_id() -> str:
    """The ``webhook-id`` of one event's delivery to one endpoint, kept on every attempt."""
    return f"wh_{secrets.token_hex(16)}"


def event_body(event_id: str, event_type: str, created_at: int, batch_id: str) -> bytes:
    """The JSON an endpoint receives (and the bytes that are signed)."""
    event = {
        "id": event_id,
        "object": "event",
        "type": event_type,
        "created_at": created_at,
        "data": {"id": batch_id},
    }
    return json.dumps(event, separators=(",", ":")).encode()


def parse_event_types(values: list[str] | None) -> list[str]:
    """The event types an endpoint asked for, deduplicated in canonical order; all of them
    when none were named. ``ValueError`` names the first unknown one."""
    if not values:
        return list(ALL_EVENT_TYPES)
    unknown = [v for v in values if v not in ALL_EVENT_TYPES]
    if unknown:
        raise ValueError(
            f"unknown event type {unknown[0]!r}; Backfill sends {', '.join(ALL_EVENT_TYPES)}"
        )
    return [t for t in ALL_EVENT_TYPES if t in values]
