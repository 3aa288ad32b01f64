"""Tenants' requests taking turns in one API process: the waiting for
:class:`backfill.tenant_requests.TenantRequests` on the event loop.

A request beyond its tenant's bound waits for a future the tenant's next finished request
resolves (the place handed over directly, first come first served), for at most
:data:`QUEUE_WAIT_S`; then it is a 429 with ``Retry-After``. Waiting holds no worker thread,
no Postgres connection and no CPU; the connection stays open and its body unread.
"""

from __future__ import annotations

import asyncio
import time

from backfill.tenant_requests import TenantRequests

QUEUE_WAIT_S = 2.0
"""How long a request waits for its tenant's turn before it is refused (a create costs the
API ~10 ms, so a tenant's queue that does not move in 2 s is well past its share)."""


class TenantTurns:
    """The edge's per-tenant queues over one event loop (not thread-safe: the loop's only)."""

    def __init__(self, bound: int, wait_s: float = QUEUE_WAIT_S) -> None:
        self.requests: TenantRequests[asyncio.Future[None]] = TenantRequests(bound)
        self.wait_s = wait_s

    async def wait_for_turn(self, tenant_id: str) -> None:
        """Returns once the request is in progress (call :meth:`done` after it); raises
        :class:`backfill.tenant_requests.TooManyRequestsInProgress` after ``wait_s``."""
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.requests.enter(tenant_id, turn):
            return
        started = time.monotonic()
        try:
            # asyncio.wait, not wait_for: a timeout must not cancel the future, which a
            # finished request may be handing its place to in this very loop iteration.
            await asyncio.wait((turn,), timeout=self.wait_s)
        except BaseException:
            # Cancelled while waiting (the client went away): give the place back if it came.
            if not self.requests.abandon(tenant_id, turn):
                self.done(tenant_id)
            raise
        if turn.done() or not self.requests.abandon(tenant_id, turn):
            return
        raise self.requests.refusal(round(time.monotonic() - started, 1))

    def done(self, tenant_id: str) -> None:
        """A request of the tenant is over: the next waiter's turn, if any."""
        waiter = self.requests.leave(tenant_id)
        if waiter is not None:
            waiter.set_result(None)
