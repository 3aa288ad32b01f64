"""Every statement about webhook endpoints, batch events and their deliveries.

- :func:`enqueue_batch_event` runs inside the transaction that moves a job to a terminal
  state (``backfill.store.jobs.move_job`` calls it): the event and one delivery per
  subscribed endpoint commit with the job's end or not at all.
- A sender claims due deliveries with ``FOR UPDATE SKIP LOCKED`` and moves each one's
  ``next_attempt_at`` past a lease in the same statement (and counts the attempt): several
  senders never take one delivery at the same moment, and one that dies mid-send leaves it
  due again once the lease ends. Its result is written only while the attempt number is
  still the one it claimed, so a sender whose lease ran out cannot overwrite a newer try.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, text

from backfill.errors import NotFound
from backfill.postgres import transaction
from backfill.refusals import InvalidRequest
from backfill.states import JobState
from backfill.webhooks.doorbell import CHANNEL
from backfill.webhooks.events import EVENT_OF_STATE, new_event_id, new_webhook_id
from backfill.webhooks.retry import AfterAttempt, AttemptResult, DeliveryState
from backfill.webhooks.sealing import SecretSeal
from backfill.webhooks.signing import new_secret, secret_hint

MAX_ERROR_CHARS = 500


@dataclass(frozen=True, slots=True)
class EndpointRecord:
    id: str
    tenant_id: str
    name: str
    url: str
    event_types: list[str]
    created_at: datetime
    updated_at: datetime
    signing_secret_hint: str
    failing_since: datetime | None = None
    """Since when every attempt to it has failed (None: its last one was delivered)."""
    disabled_at: datetime | None = None
    """When it was disabled for failing too long (None: enabled); nothing is sent to it."""
    disabled_reason: str | None = None


@dataclass(frozen=True, slots=True)
class DeliveryRecord:
    """One line of the delivery log."""

    webhook_id: str
    endpoint_id: str
    event_id: str
    event_type: str
    batch_id: str
    state: DeliveryState
    attempts: int
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: datetime | None
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    failed_at: datetime | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class ClaimedDelivery:
    """A delivery a sender holds for one attempt (number ``attempt``) until its lease ends."""

    delivery_id: int
    attempt: int
    webhook_id: str
    event_id: str
    event_type: str
    batch_id: str
    event_created_at: int
    """Unix seconds, as the event's ``created_at``."""
    age_s: float
    """Seconds from the event to this claim, on Postgres' clock."""
    url: str
    secrets: tuple[str, ...]
    endpoint_id: str = ""
    failing: bool = False
    """Its endpoint's attempts were failing when it was claimed."""


class EndpointLimitReached(InvalidRequest):
    default_code = "webhook_endpoint_limit_reached"


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
    if not endpoints:
        return 0
    event_id = new_event_id()
    conn.execute(
        text(
            "INSERT INTO webhook_events (id, tenant_id, job_id, type) "
            "VALUES (:id, :tenant, :job, :type)"
        ),
        {"id": event_id, "tenant": endpoints[0][1], "job": job_id, "type": event_type.value},
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


_ENDPOINT_COLUMNS = (
    "id, tenant_id, name, url, event_types, created_at, updated_at, secret, failing_since, "
    "disabled_at, disabled_reason"
)

_DELIVERY_COLUMNS = (
    "d.webhook_id, d.endpoint_id, d.event_id, e.type, e.job_id, d.state, d.attempts, "
    "d.last_status_code, d.last_error, d.last_attempt_at, d.next_attempt_at, d.delivered_at, "
    "d.failed_at, d.created_at"
)


def _endpoint(row: Any, seal: SecretSeal) -> EndpointRecord:
    return EndpointRecord(
        id=row[0],
        tenant_id=row[1],
        name=row[2],
        url=row[3],
        event_types=list(row[4]),
        created_at=row[5],
        updated_at=row[6],
        signing_secret_hint=secret_hint(seal.open(row[7])),
        failing_since=row[8],
        disabled_at=row[9],
        disabled_reason=row[10],
    )


def _delivery(row: Any) -> DeliveryRecord:
    state = DeliveryState(row[5])
    return DeliveryRecord(
        webhook_id=row[0],
        endpoint_id=row[1],
        event_id=row[2],
        event_type=row[3],
        batch_id=row[4],
        state=state,
        attempts=row[6],
        last_status_code=row[7],
        last_error=row[8],
        last_attempt_at=row[9],
        next_attempt_at=row[10] if state is DeliveryState.PENDING else None,
        delivered_at=row[11],
        failed_at=row[12],
        created_at=row[13],
    )


def new_endpoint_id() -> str:
    return f"we_{secrets.token_hex(12)}"


# Each enabled endpoint's due deliveries (at most :per each), healthy endpoints first, then
# in turns: every endpoint's oldest, then every one's second, and so on.
_DUE_CANDIDATES = (
    "SELECT id, endpoint_id, failing FROM (SELECT d.id, d.endpoint_id, "
    "  d.next_attempt_at, p.failing_since IS NOT NULL AS failing, "
    "  row_number() OVER (PARTITION BY d.endpoint_id "
    "  ORDER BY d.next_attempt_at, d.id) AS turn FROM webhook_endpoints p "
    "  CROSS JOIN LATERAL (SELECT id, endpoint_id, next_attempt_at "
    "    FROM webhook_deliveries WHERE endpoint_id = p.id AND state = 'pending' "
    "    AND next_attempt_at <= now() ORDER BY next_attempt_at LIMIT :per) d "
    "  WHERE p.disabled_at IS NULL) q "
    "ORDER BY failing, turn, next_attempt_at, id"
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
    "RETURNING d.id, d.attempts, d.webhook_id, e.id, e.type, e.job_id, "
    "  CAST(EXTRACT(EPOCH FROM e.created_at) AS bigint), "
    "  EXTRACT(EPOCH FROM now() - e.created_at), p.url, p.secret, "
    "  CASE WHEN p.previous_secret_until > now() THEN p.previous_secret END, "
    "  d.endpoint_id, p.failing_since IS NOT NULL"
)


def choose_due(
    candidates: Sequence[tuple[int, str, bool]],
    limit: int,
    cap: int,
    held: dict[str, int],
    failing_room: int,
) -> list[int]:
    """Of ``candidates`` (delivery id, endpoint id, whether the endpoint is failing), in the
    order to take them, up to ``limit`` ids: at most ``cap`` in flight per endpoint counting
    those ``held`` already (updated with what is chosen), at most ``failing_room`` of
    failing endpoints'. Pure."""
    chosen: list[int] = []
    failing_left = failing_room
    for delivery_id, endpoint_id, failing in candidates:
        if len(chosen) >= limit:
            break
        if held.get(endpoint_id, 0) >= cap or (failing and failing_left <= 0):
            continue
        if failing:
            failing_left -= 1
        held[endpoint_id] = held.get(endpoint_id, 0) + 1
        chosen.append(delivery_id)
    return chosen


class WebhookStore:
    """Postgres access for webhooks, over the deployment's engine (thread-safe)."""

    def __init__(self, engine: Engine, seal: SecretSeal | None = None) -> None:
        self.engine = engine
        self.seal = seal or SecretSeal()
        """Signing secrets are stored as it seals them, and opened with it."""

    @contextmanager
    def _tx(self) -> Iterator[Connection]:
        # The store's one transaction, with its translation of driver errors.
        with transaction(self.engine) as conn:
            yield conn

    # -- endpoints ----------------------------------------------------------------------------

    def create_endpoint(
        self, tenant_id: str, *, name: str, url: str, event_types: list[str], limit: int
    ) -> tuple[EndpointRecord, str]:
        """A new endpoint and its signing secret (returned only here)."""
        secret = new_secret()
        with self._tx() as conn:
            # The tenant's row orders concurrent creates, so the limit holds under races.
            conn.execute(
                text("SELECT 1 FROM tenants WHERE id = :t FOR NO KEY UPDATE"), {"t": tenant_id}
            )
            count = conn.execute(
                text("SELECT count(*) FROM webhook_endpoints WHERE tenant_id = :t"),
                {"t": tenant_id},
            ).scalar_one()
            if count >= limit:
                raise EndpointLimitReached(
                    f"a tenant may have {limit} webhook endpoints; delete one first"
                )
            row = conn.execute(
                text(
                    "INSERT INTO webhook_endpoints (id, tenant_id, name, url, event_types, "
                    "secret) VALUES (:id, :t, :n, :u, :e, :s) "
                    f"RETURNING {_ENDPOINT_COLUMNS}"
                ),
                {
                    "id": new_endpoint_id(),
                    "t": tenant_id,
                    "n": name,
                    "u": url,
                    "e": event_types,
                    "s": self.seal.seal(secret),
                },
            ).one()
        return _endpoint(row, self.seal), secret

    def endpoint(self, tenant_id: str, endpoint_id: str) -> EndpointRecord:
        with self._tx() as conn:
            row = conn.execute(
                text(
                    f"SELECT {_ENDPOINT_COLUMNS} FROM webhook_endpoints "
                    "WHERE id = :i AND tenant_id = :t"
                ),
                {"i": endpoint_id, "t": tenant_id},
            ).first()
        if row is None:
            raise NotFound(f"No such webhook endpoint: {endpoint_id}")
        return _endpoint(row, self.seal)

    def endpoint_target(self, tenant_id: str, endpoint_id: str) -> tuple[str, tuple[str, ...]]:
        """An endpoint's URL and the secrets a delivery to it is signed with now (the
        current one, and a rotated-out one still in its window)."""
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "SELECT url, secret, CASE WHEN previous_secret_until > now() "
                    "THEN previous_secret END FROM webhook_endpoints "
                    "WHERE id = :i AND tenant_id = :t"
                ),
                {"i": endpoint_id, "t": tenant_id},
            ).first()
        if row is None:
            raise NotFound(f"No such webhook endpoint: {endpoint_id}")
        return row[0], self._open(row[1], row[2])

    def _open(self, secret: str, previous: str | None) -> tuple[str, ...]:
        opened = self.seal.open(secret)
        return (opened,) if previous is None else (opened, self.seal.open(previous))

    def endpoints(
        self, tenant_id: str, *, after: str | None = None, limit: int = 20
    ) -> list[EndpointRecord]:
        """Newest first; ``after`` an endpoint id of the previous page."""
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    f"SELECT {_ENDPOINT_COLUMNS} FROM webhook_endpoints WHERE tenant_id = :t "
                    "AND (CAST(:after AS text) IS NULL OR (created_at, id) < (SELECT "
                    "created_at, id FROM webhook_endpoints WHERE id = :after AND tenant_id = :t))"
                    " ORDER BY created_at DESC, id DESC LIMIT :l"
                ),
                {"t": tenant_id, "after": after, "l": limit},
            ).all()
        return [_endpoint(r, self.seal) for r in rows]

    def update_endpoint(
        self,
        tenant_id: str,
        endpoint_id: str,
        *,
        name: str | None = None,
        url: str | None = None,
        event_types: list[str] | None = None,
        enable: bool = False,
    ) -> EndpointRecord:
        """Change what is given; ``updated_at`` moves only when something changed. Pending
        deliveries go to the new URL. A disabled endpoint is enabled again by a new URL or
        by ``enable``."""
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE webhook_endpoints w SET name = coalesce(:n, w.name), "
                    "url = coalesce(:u, w.url), event_types = coalesce(:e, w.event_types), "
                    "updated_at = CASE WHEN (coalesce(:n, w.name), coalesce(:u, w.url), "
                    "coalesce(:e, w.event_types)) IS DISTINCT FROM (w.name, w.url, "
                    "w.event_types) THEN now() ELSE w.updated_at END, "
                    "disabled_at = CASE WHEN :enable OR coalesce(:u, w.url) <> w.url THEN NULL "
                    "ELSE w.disabled_at END, "
                    "disabled_reason = CASE WHEN :enable OR coalesce(:u, w.url) <> w.url "
                    "THEN NULL ELSE w.disabled_reason END, "
                    "failing_since = CASE WHEN :enable OR coalesce(:u, w.url) <> w.url THEN NULL "
                    "ELSE w.failing_since END "
                    f"WHERE id = :i AND tenant_id = :t RETURNING {_ENDPOINT_COLUMNS}"
                ),
                {
                    "i": endpoint_id,
                    "t": tenant_id,
                    "n": name,
                    "u": url,
                    "e": event_types,
                    "enable": enable,
                },
            ).first()
        if row is None:
            raise NotFound(f"No such webhook endpoint: {endpoint_id}")
        return _endpoint(row, self.seal)

    def rotate_secret(
        self, tenant_id: str, endpoint_id: str, *, keep_old_for_s: float = 0.0
    ) -> tuple[EndpointRecord, str]:
        """A new signing secret; the old one keeps signing beside it for ``keep_old_for_s``."""
        secret = new_secret()
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE webhook_endpoints SET previous_secret = CASE WHEN :keep > 0 "
                    "THEN secret END, previous_secret_until = CASE WHEN :keep > 0 THEN "
                    "now() + make_interval(secs => CAST(:keep AS float8)) END, "
                    "secret = :s, updated_at = now() "
                    f"WHERE id = :i AND tenant_id = :t RETURNING {_ENDPOINT_COLUMNS}"
                ),
                {
                    "i": endpoint_id,
                    "t": tenant_id,
                    "s": self.seal.seal(secret),
                    "keep": keep_old_for_s,
                },
            ).first()
        if row is None:
            raise NotFound(f"No such webhook endpoint: {endpoint_id}")
        return _endpoint(row, self.seal), secret

    def delete_endpoint(self, tenant_id: str, endpoint_id: str) -> None:
        """The endpoint and its delivery log; a send in flight to it records nothing."""
        with self._tx() as conn:
            deleted = conn.execute(
                text("DELETE FROM webhook_endpoints WHERE id = :i AND tenant_id = :t"),
                {"i": endpoint_id, "t": tenant_id},
            ).rowcount
        if not deleted:
            raise NotFound(f"No such webhook endpoint: {endpoint_id}")

    # -- the delivery log ---------------------------------------------------------------------

    def deliveries(
        self,
        tenant_id: str,
        *,
        endpoint_id: str | None = None,
        batch_id: str | None = None,
        after: str | None = None,
        limit: int = 20,
    ) -> list[DeliveryRecord]:
        """Newest first; ``after`` a webhook id of the previous page."""
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    f"SELECT {_DELIVERY_COLUMNS} FROM webhook_deliveries d "
                    "JOIN webhook_events e ON e.id = d.event_id WHERE d.tenant_id = :t "
                    "AND (CAST(:ep AS text) IS NULL OR d.endpoint_id = :ep) "
                    "AND (CAST(:b AS text) IS NULL OR e.job_id = :b) "
                    "AND (CAST(:after AS text) IS NULL OR d.id < (SELECT id FROM "
                    "webhook_deliveries WHERE webhook_id = :after AND tenant_id = :t)) "
                    "ORDER BY d.id DESC LIMIT :l"
                ),
                {"t": tenant_id, "ep": endpoint_id, "b": batch_id, "after": after, "l": limit},
            ).all()
        return [_delivery(r) for r in rows]

    # -- the sender ---------------------------------------------------------------------------

    def clear_expired_secrets(self) -> int:
        """Forget the rotated-out secrets whose window has ended (they sign nothing after it;
        kept, they would only be one more secret to leak); returns how many."""
        with self._tx() as conn:
            result = conn.execute(
                text(
                    "UPDATE webhook_endpoints SET previous_secret = NULL, "
                    "previous_secret_until = NULL WHERE previous_secret IS NOT NULL "
                    "AND previous_secret_until <= now()"
                )
            )
        return int(result.rowcount or 0)

    def reseal_secrets(self, after: str = "", limit: int = 100) -> tuple[int, str]:
        """Seal, under the first key, the secrets of up to ``limit`` endpoints after id
        ``after`` that are stored in clear or under another key; returns how many endpoints
        changed and where the next call starts ("" once the walk is done)."""
        changed = 0
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, secret, previous_secret FROM webhook_endpoints WHERE id > :a "
                    "ORDER BY id LIMIT :l FOR NO KEY UPDATE SKIP LOCKED"
                ),
                {"a": after, "l": limit},
            ).all()
            for endpoint_id, secret, previous in rows:
                sealed = self.seal.reseal(secret)
                sealed_previous = self.seal.reseal(previous) if previous is not None else None
                if sealed is None and sealed_previous is None:
                    continue
                conn.execute(
                    text(
                        "UPDATE webhook_endpoints SET secret = :s, "
                        "previous_secret = COALESCE(:p, previous_secret) WHERE id = :i"
                    ),
                    {"i": endpoint_id, "s": sealed or secret, "p": sealed_previous},
                )
                changed += 1
        return changed, rows[-1][0] if len(rows) == limit else ""

    def claim_due(
        self,
        limit: int,
        lease_s: float,
        *,
        busy: Mapping[str, int] | None = None,
        per_endpoint: int | None = None,
        failing_room: int | None = None,
    ) -> list[ClaimedDelivery]:
        """Up to ``limit`` due deliveries, each held for ``lease_s`` and its attempt counted.

        Endpoints take turns: each endpoint's oldest due delivery first, then each one's
        second, and so on, so one endpoint's backlog (or a slow endpoint's retries) does not
        hold every other tenant's deliveries behind it. With ``per_endpoint``, no endpoint
        gets more than that many in flight, counting the ``busy`` ones this sender already
        holds (endpoint id -> attempts in flight). Endpoints whose attempts are failing
        come after the healthy ones, at most ``failing_room`` of theirs, and a disabled
        endpoint's deliveries are not claimed at all."""
        held = dict(busy or {})
        cap = per_endpoint if per_endpoint is not None else limit
        with self._tx() as conn:
            candidates = conn.execute(text(_DUE_CANDIDATES), {"per": cap}).all()
            chosen = choose_due(
                [(r[0], r[1], bool(r[2])) for r in candidates],
                limit,
                cap,
                held,
                failing_room if failing_room is not None else limit,
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
                batch_id=r[5],
                event_created_at=int(r[6]),
                age_s=float(r[7]),
                url=r[8],
                secrets=self._open(r[9], r[10]),
                endpoint_id=r[11],
                failing=bool(r[12]),
            )
            for r in rows
        ]

    def record_attempt(
        self,
        claimed: ClaimedDelivery,
        result: AttemptResult,
        after: AfterAttempt,
        *,
        disable_after_s: float | None = None,
    ) -> bool:
        """Write an attempt's result and what follows; False when the claim is stale (its
        lease ran out and another sender tried again, or the endpoint was deleted). The
        endpoint's health moves with it: a delivered attempt clears ``failing_since``, a
        failed one sets it if clear, and an endpoint failing for ``disable_after_s`` is
        disabled with this attempt's error as the reason."""
        error = None if result.error is None else result.error[:MAX_ERROR_CHARS]
        with self._tx() as conn:
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
                conn.execute(
                    text(
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
                        "WHERE id = :e"
                    ),
                    {
                        "ok": delivered,
                        "after": disable_after_s,
                        "reason": reason,
                        "e": claimed.endpoint_id,
                    },
                )
        return bool(applied)
