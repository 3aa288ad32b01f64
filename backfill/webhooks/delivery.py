"""The sender: claims due deliveries, posts each signed event, records what came of it.

Decide apart from act: :func:`prepare` (pure) turns a claimed delivery into the request to
send, ``backfill.webhooks.retry.after_attempt`` (pure) says what follows an attempt; the
:class:`Sender` only claims, sends and records. A round's sends run side by side, each
bounded by ``webhooks_timeout_s`` in all (connect, send and the answer's headers together:
:class:`~backfill.webhooks.deadline.Deadline`), well inside the claim's lease.

Delivery is at least once: a sender that dies after the endpoint answered but before the
result was written leaves the delivery due again when its lease ends, and the next attempt
carries the same ``webhook-id`` (receivers drop duplicates by it).

It runs in the process that schedules maintenance (``backfill beat``, or ``backfill worker
--beat``), or alone (``python -m backfill.webhooks``); any number may run at once.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import httpx
from sqlalchemy import create_engine

from backfill.config import Settings, libpq_url
from backfill.errors import StoreUnavailable
from backfill.webhooks.deadline import Deadline
from backfill.webhooks.doorbell import Doorbell
from backfill.webhooks.events import event_body
from backfill.webhooks.outbox import ClaimedDelivery
from backfill.webhooks.retry import (
    AfterAttempt,
    AttemptResult,
    DeliveryState,
    RetryPolicy,
    after_attempt,
)
from backfill.webhooks.sealing import CLEAR_SECRETS_WARNING, SecretSeal
from backfill.webhooks.signing import signed_headers
from backfill.webhooks.store import WebhookStore
from backfill.webhooks.targets import Resolver, Target, TargetRefused, check_target, system_resolver

log = logging.getLogger("backfill.webhooks")

USER_AGENT = "Backfill-Webhooks/1"
CLEAR_SECRETS_EVERY_S = 60.0
"""How often a sender forgets the rotated-out secrets whose window has ended, and seals the
secrets still stored in clear or under an older key."""


@dataclass(frozen=True, slots=True)
class OutgoingRequest:
    """One attempt, ready to send: where to connect and what to say."""

    target: Target
    headers: dict[str, str]
    body: bytes


def prepare(claimed: ClaimedDelivery, target: Target, now: int) -> OutgoingRequest:
    """The request of one attempt at ``now`` (unix seconds: the signed timestamp)."""
    body = event_body(
        claimed.event_id, claimed.event_type, claimed.event_created_at, claimed.subject_id
    )
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "host": target.host_header,
        **signed_headers(claimed.secrets, claimed.webhook_id, now, body),
    }
    return OutgoingRequest(target, headers, body)


class Poster:
    """Sends one signed event to a checked target, bounded in all by ``webhooks_timeout_s``;
    never raises (whatever went wrong is the attempt's error)."""

    def __init__(
        self,
        settings: Settings,
        *,
        resolve: Resolver = system_resolver,
        clock: Callable[[], float] = time.time,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """``verify``: how https targets' certificates are checked (the system's trust
        store by default; tests pass their own authority). They are checked against the
        URL's host name, not the address connected to."""
        self.settings = settings
        self._resolve = resolve
        self._clock = clock
        # No pooled connections: a pooled one would be reused by address, with another
        # host's TLS name. No proxies from the environment: the send must reach the
        # address that was checked. No redirects: a 3xx is a failed attempt.
        self._http = httpx.Client(
            timeout=settings.webhooks_timeout_s,
            follow_redirects=False,
            trust_env=False,
            limits=httpx.Limits(max_keepalive_connections=0),
            verify=verify,
        )

    def close(self) -> None:
        self._http.close()

    def post(self, claimed: ClaimedDelivery) -> AttemptResult:
        try:
            target = check_target(
                claimed.url,
                allow_private=self.settings.webhooks_allow_private,
                resolve=self._resolve,
            )
        except TargetRefused as exc:
            return AttemptResult(error=str(exc))
        request = prepare(claimed, target, int(self._clock()))
        limit = self.settings.webhooks_timeout_s
        deadline = Deadline(limit)
        extensions: dict[str, object] = {"trace": deadline.trace}
        if target.scheme == "https":
            extensions["sni_hostname"] = target.host
        try:
            with (
                deadline,
                self._http.stream(
                    "POST",
                    target.connect_url,
                    content=request.body,
                    headers=request.headers,
                    extensions=extensions,
                ) as response,
            ):
                # The answer's body is not wanted (and may be large): only its status.
                return AttemptResult(status_code=response.status_code)
        except httpx.TimeoutException:
            return AttemptResult(error=f"no answer within {limit:g} s")
        except httpx.HTTPError as exc:
            if deadline.expired:
                return AttemptResult(
                    error=f"no whole answer within {limit:g} s (connect, send and the answer's "
                    "headers together)"
                )
            return AttemptResult(error=f"{type(exc).__name__}: {exc}".rstrip(": "))


def retry_policy(settings: Settings) -> RetryPolicy:
    return RetryPolicy(
        base_s=settings.webhooks_retry_base_s,
        max_delay_s=settings.webhooks_retry_max_delay_s,
        retry_for_s=settings.webhooks_retry_for_s,
    )


@dataclass
class RoundReport:
    claimed: int = 0
    delivered: int = 0
    retrying: int = 0
    failed: int = 0
    stale: int = 0
    """Results not written: the claim's lease had run out (or its endpoint was deleted)."""
    outcomes: dict[str, DeliveryState] = field(default_factory=dict)
    """webhook-id -> state after this round's attempt."""

    def add(self, delivery: ClaimedDelivery, after: AfterAttempt, applied: bool) -> None:
        if not applied:
            self.stale += 1
            return
        self.outcomes[delivery.webhook_id] = after.state
        if after.state is DeliveryState.DELIVERED:
            self.delivered += 1
        elif after.state is DeliveryState.FAILED:
            self.failed += 1
        else:
            self.retrying += 1


Outcome = tuple[ClaimedDelivery, AfterAttempt, bool]
"""One attempt's delivery, what follows it, and whether its result was written."""

SLOW_SEND_S = 1.0
"""A send in flight longer than this counts with the failing endpoints' sends: together they
hold at most half of a sender's slots (an endpoint that drips its answer is found out by
its first attempt, not after it)."""


@dataclass(frozen=True, slots=True)
class InFlight:
    claimed: ClaimedDelivery
    started: float
    """``time.monotonic()`` when its send was handed to the pool."""


class Sender:
    """Delivers due webhook events; :meth:`run_round` once, :meth:`run` until stopped."""

    def __init__(
        self,
        store: WebhookStore,
        settings: Settings,
        *,
        resolve: Resolver = system_resolver,
        clock: Callable[[], float] = time.time,
        jitter: Callable[[], float] = random.random,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """``verify``: how https targets' certificates are checked (see :class:`Poster`)."""
        self.store = store
        self.settings = settings
        self.policy = retry_policy(settings)
        self._clock = clock
        self._clear_secrets_at = 0.0
        self._reseal_after = ""
        self._jitter = jitter
        self._poster = Poster(settings, resolve=resolve, clock=clock, verify=verify)
        self._pool = ThreadPoolExecutor(
            max_workers=settings.webhooks_claim_batch, thread_name_prefix="webhook-send"
        )

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._poster.close()

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self._clear_secrets_at:
            # Housekeeping, not a round's work: at most once a minute.
            self.store.clear_expired_secrets()
            if self.store.seal.sealing:
                resealed, self._reseal_after = self.store.reseal_secrets(self._reseal_after)
                if resealed:
                    log.info("sealed the signing secrets of %d webhook endpoints", resealed)
            self._clear_secrets_at = now + CLEAR_SECRETS_EVERY_S

    def _claim(self, limit: int, in_flight: Iterable[InFlight]) -> list[ClaimedDelivery]:
        """Up to ``limit`` more, beside those ``in_flight``, within the bounds per endpoint
        and per tenant: sends to failing endpoints and sends already slower than
        ``SLOW_SEND_S`` hold at most half of the slots between them (healthy endpoints are
        claimed first)."""
        held = list(in_flight)
        now = time.monotonic()
        slow = sum(1 for f in held if f.claimed.failing or now - f.started > SLOW_SEND_S)
        return self.store.claim_due(
            limit,
            self.settings.webhooks_lease_s,
            busy=Counter(f.claimed.endpoint_id for f in held),
            busy_tenants=Counter(f.claimed.tenant_id for f in held),
            per_endpoint=self.settings.webhooks_per_endpoint,
            per_tenant=self.settings.webhooks_per_tenant,
            failing_room=max(1, self.settings.webhooks_claim_batch // 2) - slow,
        )

    def run_round(self) -> RoundReport:
        """One claim of due deliveries, each attempted, all waited for."""
        self._housekeeping()
        claimed = self._claim(self.settings.webhooks_claim_batch, ())
        report = RoundReport(claimed=len(claimed))
        for outcome in self._pool.map(self._attempt, claimed):
            report.add(*outcome)
        return report

    def _attempt(self, claimed: ClaimedDelivery) -> Outcome:
        result = self.send(claimed)
        after = after_attempt(
            result,
            attempts=claimed.attempt,
            age_s=claimed.age_s,
            policy=self.policy,
            jitter=self._jitter(),
        )
        if after.state is DeliveryState.FAILED:
            log.warning(
                "webhook %s to %s failed for good after %s attempts: %s",
                claimed.webhook_id,
                claimed.url,
                claimed.attempt,
                result.error or f"status {result.status_code}",
            )
        applied = self.store.record_attempt(
            claimed, result, after, disable_after_s=self.settings.webhooks_disable_after_s
        )
        return claimed, after, applied

    def send(self, claimed: ClaimedDelivery) -> AttemptResult:
        """One attempt; never raises (whatever went wrong is the attempt's error)."""
        return self._poster.post(claimed)

    def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set: claims as sends finish, so one slow receiver holds one send
        slot for at most ``webhooks_timeout_s``, never a round of everyone's; each endpoint
        has at most ``webhooks_per_endpoint`` attempts in flight and each tenant
        ``webhooks_per_tenant``, and tenants take turns at the free slots
        (``WebhookStore.claim_due``). Sends in flight when it stops are
        finished first."""
        if not self.store.seal.sealing:
            log.warning(CLEAR_SECRETS_WARNING)
        in_flight: dict[Future[Outcome], InFlight] = {}
        poll_s = self.settings.webhooks_poll_s
        # Deliveries queued while it idles ring the bell: it claims at once, not at its poll.
        bell = Doorbell(libpq_url(self.store.engine.url.render_as_string(hide_password=False)))
        look, next_poll = True, 0.0
        try:
            while not stop.is_set():
                free = self.settings.webhooks_claim_batch - len(in_flight)
                if free > 0 and (look or time.monotonic() >= next_poll):
                    next_poll = time.monotonic() + poll_s
                    try:
                        self._housekeeping()
                        for claimed in self._claim(free, in_flight.values()):
                            future = self._pool.submit(self._attempt, claimed)
                            in_flight[future] = InFlight(claimed, time.monotonic())
                    except StoreUnavailable as exc:
                        log.warning("webhook sender: %s", exc)
                    except Exception:
                        log.exception("webhook sender: claiming failed")
                rung = bell.rung()
                # At most a second at a time, so a stop is seen soon whatever the poll.
                until_poll = max(0.0, next_poll - time.monotonic())
                waited: list[Future[Any]] = [*in_flight, rung]
                done, _ = wait(waited, timeout=min(1.0, until_poll), return_when=FIRST_COMPLETED)
                sent: set[Future[Outcome]] = {f for f in in_flight if f in done}
                # A send ended (a slot is free) or the bell rang: look again now.
                look = bool(sent) or rung.done()
                self._settle(sent, in_flight)
        finally:
            bell.close()
            self._settle(wait(in_flight).done, in_flight)

    def _settle(
        self, done: set[Future[Outcome]], in_flight: dict[Future[Outcome], InFlight]
    ) -> None:
        report = RoundReport(claimed=len(done))
        for future in done:
            claimed = in_flight.pop(future).claimed
            try:
                report.add(*future.result())
            except Exception:
                # Its result was not written: the delivery is due again when its lease ends.
                log.exception("webhook %s: recording the attempt failed", claimed.webhook_id)
        if report.delivered or report.retrying or report.failed:
            log.info(
                "webhooks: %s delivered, %s to retry, %s failed",
                report.delivered,
                report.retrying,
                report.failed,
            )


class SenderThread:
    """The sender on a daemon thread of a process that does other things (beat)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SenderThread:
        self._thread = threading.Thread(target=self._main, name="webhook-sender", daemon=True)
        self._thread.start()
        return self

    def _main(self) -> None:
        engine = create_engine(self.settings.database_url, pool_size=4, max_overflow=4)
        sender = Sender(
            WebhookStore(engine, SecretSeal(self.settings.webhooks_seal_keys)), self.settings
        )
        try:
            sender.run(self._stop)
        finally:
            sender.close()
            engine.dispose()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
