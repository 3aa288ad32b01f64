"""A tenant's webhook endpoints, their signing secrets and the delivery log: every statement
about them, over the deployment's engine.

Batch events and the queue of their deliveries are the outbox's
(:mod:`backfill.webhooks.outbox`); :class:`WebhookStore` opens the transaction its sender's
claims and results run in.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Engine, text

from backfill.errors import NotFound
from backfill.postgres import transaction
from backfill.refusals import InvalidRequest
from backfill.webhooks import outbox
from backfill.webhooks.outbox import ClaimedDelivery
from backfill.webhooks.retry import AfterAttempt, AttemptResult, DeliveryState
from backfill.webhooks.sealing import SecretSeal
from backfill.webhooks.signing import new_secret, secret_hint


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
    batch_id: str | None
    """The batch whose end the event says (None: ``webhook_endpoint.disabled``)."""
    state: DeliveryState
    attempts: int
    last_status_code: int | None
    last_error: str | None
    last_attempt_at: datetime | None
    next_attempt_at: datetime | None
    delivered_at: datetime | None
    failed_at: datetime | None
    created_at: datetime
    subject_id: str = ""
    """The event's ``data.id``: its batch, or the endpoint it says was disabled."""


class EndpointLimitReached(InvalidRequest):
    default_code = "webhook_endpoint_limit_reached"


_ENDPOINT_COLUMNS = (
    "id, tenant_id, name, url, event_types, created_at, updated_at, secret, failing_since, "
    "disabled_at, disabled_reason"
)

_DELIVERY_COLUMNS = (
    "d.webhook_id, d.endpoint_id, d.event_id, e.type, e.job_id, d.state, d.attempts, "
    "d.last_status_code, d.last_error, d.last_attempt_at, d.next_attempt_at, d.delivered_at, "
    "d.failed_at, d.created_at, coalesce(e.job_id, e.subject_id)"
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
        subject_id=row[14],
    )


def new_endpoint_id() -> str:
    return f"we_{secrets.token_hex(12)}"


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
        return self._found(row, endpoint_id)

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

    def _found(self, row: Any, endpoint_id: str) -> EndpointRecord:
        # A statement's row of the endpoint, or the 404 when the tenant has no such endpoint.
        if row is None:
            raise NotFound(f"No such webhook endpoint: {endpoint_id}")
        return _endpoint(row, self.seal)

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
        return self._found(row, endpoint_id)

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
        return self._found(row, endpoint_id), secret

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
        busy_tenants: Mapping[str, int] | None = None,
        per_endpoint: int | None = None,
        per_tenant: int | None = None,
        failing_room: int | None = None,
    ) -> list[ClaimedDelivery]:
        """Up to ``limit`` due deliveries, each held for ``lease_s`` and its attempt counted.

        Tenants take turns: each tenant's first due delivery, then each one's second, and so
        on (within a tenant its endpoints take turns, each one's oldest first), so neither one
        endpoint's backlog nor a tenant's many endpoints hold every other tenant's deliveries
        behind them. With ``per_endpoint`` (``per_tenant``), no endpoint (tenant) gets more
        than that many in flight, counting the ones this sender already holds, ``busy``
        (endpoint id -> attempts in flight) and ``busy_tenants`` (tenant id -> attempts).
        Endpoints whose attempts are failing come after the healthy ones, at most
        ``failing_room`` of theirs, and a disabled endpoint's deliveries are not claimed at
        all."""
        room = outbox.SendRoom(
            limit=limit,
            per_endpoint=per_endpoint if per_endpoint is not None else limit,
            per_tenant=per_tenant if per_tenant is not None else limit,
            failing=failing_room if failing_room is not None else limit,
        )
        with self._tx() as conn:
            return outbox.claim_due(
                conn,
                room,
                lease_s,
                held=dict(busy or {}),
                tenants_held=dict(busy_tenants or {}),
                open_secrets=self._open,
            )

    def record_attempt(
        self,
        claimed: ClaimedDelivery,
        result: AttemptResult,
        after: AfterAttempt,
        *,
        disable_after_s: float | None = None,
    ) -> bool:
        """The outbox's :func:`~backfill.webhooks.outbox.record_attempt`, in a transaction of
        its own."""
        with self._tx() as conn:
            return outbox.record_attempt(
                conn, claimed, result, after, disable_after_s=disable_after_s
            )
