"""The outbox: batch events, their deliveries, and the queue senders take them from.

- :func:`enqueue_batch_event` runs inside the transaction that moves a job to a terminal
  state (``backfill.store.jobs.move_job`` calls it): the event and one delivery per
  subscribed endpoint commit with the job's end or not at all. An endpoint disabled by
  :func:`record_attempt` is an event too, in the same transaction
  (``webhook_endpoint.disabled``, to the tenant's other endpoints that named it).
- A sender claims due deliveries (:func:`claim_due`) with ``FOR UPDATE SKIP LOCKED`` and
  moves each one's ``next_attempt_at`` past a lease in the same statement (and counts the
  attempt): several senders never take one delivery at the same moment, and one that dies
  mid-send leaves it due again once the lease ends. Its result is written
  (:func:`record_attempt`) only while the attempt number is still the one it claimed, so a
  sender whose lease ran out cannot overwrite a newer try.

Each function runs in the caller's transaction; ``backfill.webhooks.store.WebhookStore``
opens it. Endpoints themselves (their settings and secrets) and the delivery log are the
store's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, text

from backfill.states import JobState
from backfill.webhooks.doorbell import CHANNEL
from backfill.webhooks.events import EVENT_OF_STATE, EventType, new_event_id, new_webhook_id
from backfill.webhooks.retry import AfterAttempt, AttemptResult, DeliveryState

MAX_ERROR_CHARS = 500

OpenSecrets = Callable[[str, "str | None"], tuple[str, ...]]
"""Opens an endpoint's stored secret and its rotated-out one (None: none) into the secrets a
delivery is signed with."""


@dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    """A delivery a sender holds for one attempt (number ``attempt``) until its lease ends."""

    delivery_id: int
    attempt: int
    webhook_id: str
    event_id: str
    event_type: str
    subject_id: str
    """The event's ``data.id``: its batch, or the endpoint it says was disabled."""
    event_created_at: int
    """Unix seconds, as the event's ``created_at``."""
    age_s: float
    """Seconds from the event to this claim, on Postgres' clock."""
    url: str
    secrets: tuple[str, ...]
    endpoint_id: str = ""
    failing: bool = False
    """Its endpoint's attempts were failing when it was claimed."""
    tenant_id: str = ""


def enqueue_batch_event(conn: Connection, job_id: str, target: JobState) -> int:
    """In the caller's transaction: the event of ``job_id`` reaching ``target`` and its
    deliveries, if ``target`` sends one and an endpoint of the job's tenant wants it.
    Returns the deliveries written."""
    event_type = EVENT_OF_STATE.get(target)
    if event_type is None:
        return 0
    endpoints = conn.execute(
        text(
            "SELECT e.id, e.tenant_id FROM webhook_endpoints e JOIN jobs j "
            "ON j.tenant_id = e.tenant_id WHERE j.id = :job AND :type = ANY(e.event_types)"
        ),
        {"job": job_id, "type": event_type.value},
    ).all()
    return _enqueue(conn, event_type, endpoints, job_id=job_id)


def enqueue_endpoint_disabled(conn: Connection, endpoint_id: str) -> int:
    """In the caller's transaction (the one that disabled ``endpoint_id``): its
    ``webhook_endpoint.disabled`` event, delivered to its tenant's other endpoints that
    named that type. Returns the deliveries written."""
    endpoints = conn.execute(
        text(
            "SELECT o.id, o.tenant_id FROM webhook_endpoints o JOIN webhook_endpoints d "
            "ON d.tenant_id = o.tenant_id WHERE d.id = :e AND o.id <> d.id "
            "AND :type = ANY(o.event_types)"
        ),
        {"e": endpoint_id, "type": EventType.WEBHOOK_ENDPOINT_DISABLED.value},
    ).all()
    return _enqueue(conn, EventType.WEBHOOK_ENDPOINT_DISABLED, endpoints, subject_id=endpoint_id)


def _enqueue(
    conn: Connection,
    event_type: EventType,
    endpoints: Sequence[Any],
    *,
    job_id: str | None = None,
    subject_id: str | None = None,
) -> int:
    """The event and a delivery to each of ``endpoints`` (rows of id, tenant id)."""
    if not endpoints:
        return 0
    event_id = new_event_id()
    conn.execute(
        text(
            "INSERT INTO webhook_events (id, tenant_id, job_id, subject_id, type) "
            "VALUES (:id, :tenant, :job, :subject, :type)"
        ),
        {
            "id": event_id,
            "tenant": endpoints[0][1],
            "job": job_id,
            "subject": subject_id,
            "type": event_type.value,
        },
    )
    conn.execute(
        text(
            "INSERT INTO webhook_deliveries (event_id, endpoint_id, tenant_id, webhook_id) "
            "SELECT :event, e, :tenant, w FROM unnest(CAST(:endpoints AS text[]), "
            "CAST(:webhook_ids AS text[])) AS v(e, w)"
        ),
        {
            "event": event_id,
            "tenant": endpoints[0][1],
            "endpoints": [row[0] for row in endpoints],
            "webhook_ids": [new_webhook_id() for _ in endpoints],
        },
    )
    # Wakes an idle sender when (and only if) this transaction commits.
    conn.execute(text("SELECT pg_notify(:channel, '')"), {"channel": CHANNEL})
    return len(endpoints)


# Each enabled endpoint's due deliveries (at most :per each), healthy endpoints first, then
# in turns between tenants: every tenant's first, then every one's second, and so on; within a
# tenant its endpoints take turns (each one's oldest, then each one's second).
_DUE_CANDIDATES = (
    "SELECT id, endpoint_id, tenant_id, failing FROM (SELECT q.*, row_number() OVER "
    "  (PARTITION BY tenant_id, failing ORDER BY turn, next_attempt_at, id) AS tenant_turn "
    "  FROM (SELECT d.id, d.endpoint_id, p.tenant_id, d.next_attempt_at, "
    "    p.failing_since IS NOT NULL AS failing, "
    "    row_number() OVER (PARTITION BY d.endpoint_id "
    "    ORDER BY d.next_attempt_at, d.id) AS turn FROM webhook_endpoints p "
    "    CROSS JOIN LATERAL (SELECT id, endpoint_id, next_attempt_at "
    "      FROM webhook_deliveries WHERE endpoint_id = p.id AND state = 'pending' "
    "      AND next_attempt_at <= now() ORDER BY next_attempt_at LIMIT :per) d "
    "    WHERE p.disabled_at IS NULL) q) r "
    "ORDER BY failing, tenant_turn, next_attempt_at, id"
)

# Hold the chosen deliveries still due for :lease seconds and count their attempt; returns
# what a sender needs to post each.
_CLAIM_DUE = (
    "WITH due AS (SELECT id FROM webhook_deliveries "
    "  WHERE id = ANY(:ids) AND state = 'pending' AND next_attempt_at <= now() "
    "  FOR UPDATE SKIP LOCKED) "
    "UPDATE webhook_deliveries d SET attempts = d.attempts + 1, "
    "  last_attempt_at = now(), "
    "  next_attempt_at = now() + make_interval(secs => CAST(:lease AS float8)) "
    "FROM due, webhook_events e, webhook_endpoints p "
    "WHERE d.id = due.id AND e.id = d.event_id AND p.id = d.endpoint_id "
    "RETURNING d.id, d.attempts, d.webhook_id, e.id, e.type, coalesce(e.job_id, e.subject_id), "
    "  CAST(EXTRACT(EPOCH FROM e.created_at) AS bigint), "
    "  EXTRACT(EPOCH FROM now() - e.created_at), p.url, p.secret, "
    "  CASE WHEN p.previous_secret_until > now() THEN p.previous_secret END, "
    "  d.endpoint_id, p.failing_since IS NOT NULL, d.tenant_id"
)


@dataclass(frozen=True, slots=True)
class SendRoom:
    """What a sender may still take: its free slots, and the bounds on attempts in flight
    per endpoint, per tenant, and for failing endpoints together."""

    limit: int
    """Deliveries to take at most."""
    per_endpoint: int
    per_tenant: int
    failing: int
    """Deliveries of failing endpoints to take at most."""


def choose_due(
    candidates: Sequence[tuple[int, str, str, bool]],
    room: SendRoom,
    held: dict[str, int],
    tenants_held: dict[str, int],
) -> list[int]:
    """Of ``candidates`` (delivery id, endpoint id, tenant id, whether the endpoint is
    failing), in the order to take them, the ids to take within ``room``, counting the
    attempts in flight ``held`` per endpoint and ``tenants_held`` per tenant (both updated
    with what is chosen). Pure."""
    chosen: list[int] = []
    failing_left = room.failing
    for delivery_id, endpoint_id, tenant_id, failing in candidates:
        if len(chosen) >= room.limit:
            break
        if held.get(endpoint_id, 0) >= room.per_endpoint:
            continue
        if tenants_held.get(tenant_id, 0) >= room.per_tenant:
            continue
        if failing and failing_left <= 0:
            continue
        if failing:
            failing_left -= 1
        held[endpoint_id] = held.get(endpoint_id, 0) + 1
        tenants_held[tenant_id] = tenants_held.get(tenant_id, 0) + 1
        chosen.append(delivery_id)
    return chosen


def claim_due(
    conn: Connection,
    room: SendRoom,
    lease_s: float,
    *,
    held: dict[str, int],
    tenants_held: dict[str, int],
    open_secrets: OpenSecrets,
) -> list[ClaimedDelivery]:
    """In the caller's transaction: the due deliveries :func:`choose_due` takes within
    ``room`` (``held`` and ``tenants_held`` as there), each held for ``lease_s`` and its
    attempt counted."""
    candidates = conn.execute(text(_DUE_CANDIDATES), {"per": room.per_endpoint}).all()
    chosen = choose_due(
        [(r[0], r[1], r[2], bool(r[3])) for r in candidates], room, held, tenants_held
    )
    if not chosen:
        return []
    rows = conn.execute(text(_CLAIM_DUE), {"ids": chosen, "lease": lease_s}).all()
    return [
        ClaimedDelivery(
            delivery_id=r[0],
            attempt=r[1],
            webhook_id=r[2],
            event_id=r[3],
            event_type=r[4],
            subject_id=r[5],
            event_created_at=int(r[6]),
            age_s=float(r[7]),
            url=r[8],
            secrets=open_secrets(r[9], r[10]),
            endpoint_id=r[11],
            failing=bool(r[12]),
            tenant_id=r[13],
        )
        for r in rows
    ]


def record_attempt(
    conn: Connection,
    claimed: ClaimedDelivery,
    result: AttemptResult,
    after: AfterAttempt,
    *,
    disable_after_s: float | None = None,
) -> bool:
    """In the caller's transaction: write an attempt's result and what follows; False when
    the claim is stale (its lease ran out and another sender tried again, or the endpoint
    was deleted). The endpoint's health moves with it: a delivered attempt clears
    ``failing_since``, a failed one sets it if clear, and an endpoint failing for
    ``disable_after_s`` is disabled with this attempt's error as the reason (and its
    ``webhook_endpoint.disabled`` event written, once)."""
    error = None if result.error is None else result.error[:MAX_ERROR_CHARS]
    applied = conn.execute(
        text(
            "UPDATE webhook_deliveries SET state = :state, last_status_code = :code, "
            "last_error = :err, next_attempt_at = CASE WHEN CAST(:retry AS float8) "
            "IS NULL THEN next_attempt_at "
            "ELSE now() + make_interval(secs => CAST(:retry AS float8)) END, "
            "delivered_at = CASE WHEN :delivered THEN now() END, "
            "failed_at = CASE WHEN :failed THEN now() END "
            "WHERE id = :id AND attempts = :attempt AND state = 'pending'"
        ),
        {
            "id": claimed.delivery_id,
            "attempt": claimed.attempt,
            "state": after.state.value,
            "delivered": after.state is DeliveryState.DELIVERED,
            "failed": after.state is DeliveryState.FAILED,
            "code": result.status_code,
            "err": error,
            "retry": after.retry_in_s,
        },
    ).rowcount
    if applied:
        delivered = after.state is DeliveryState.DELIVERED
        reason = error or f"the endpoint answered {result.status_code}"
        disabled_now = conn.execute(
            text(
                "WITH was AS (SELECT disabled_at FROM webhook_endpoints WHERE id = :e "
                "FOR UPDATE) "
                "UPDATE webhook_endpoints SET failing_since = CASE WHEN :ok THEN NULL "
                "ELSE coalesce(failing_since, now()) END, "
                "disabled_at = CASE WHEN NOT :ok AND failing_since <= now() - "
                "make_interval(secs => CAST(:after AS float8)) THEN now() "
                "ELSE disabled_at END, "
                "disabled_reason = CASE WHEN NOT :ok AND failing_since <= now() - "
                "make_interval(secs => CAST(:after AS float8)) THEN "
                "'every attempt failed since ' || "
                "to_char(failing_since, 'YYYY-MM-DD HH24:MI:SS TZ') || '; the last: ' "
                "|| CAST(:reason AS text) ELSE disabled_reason END "
                "WHERE id = :e RETURNING (SELECT disabled_at FROM was) IS NULL "
                "AND disabled_at IS NOT NULL"
            ),
            {
                "ok": delivered,
                "after": disable_after_s,
                "reason": reason,
                "e": claimed.endpoint_id,
            },
        ).scalar()
        if disabled_now:
            enqueue_endpoint_disabled(conn, claimed.endpoint_id)
    return bool(applied)
