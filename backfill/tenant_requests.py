"""How many requests of one tenant an API process works on at once, and who is next.

One API process is one interpreter: every request it works on shares its CPU (and the GIL).
A tenant flooding cheap-but-not-free requests (creates of large files, each ~10 ms of the
interpreter) kept dozens in progress, and every other tenant's read queued behind all of
them. With a bound, a tenant's requests beyond it wait in that tenant's own queue, first
come first served, costing nothing (no CPU, no worker thread, no Postgres connection), and
are refused after a short wait; so another tenant's request never waits behind more than
the bound of one tenant's.

This is the decision alone (who holds a place, whom a freed place goes to), for one event
loop: no locks, no clock. The API edge does the waiting.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

from backfill.refusals import RateLimited

RETRY_AFTER_S = 1.0

Waiter = TypeVar("Waiter")


class TooManyRequestsInProgress(RateLimited):
    default_code = "too_many_requests_in_progress"


class TenantRequests(Generic[Waiter]):
    """At most ``bound`` requests of each tenant in progress; the rest queue per tenant.

    :meth:`enter` admits a request or queues its ``waiter``; :meth:`leave` frees a place,
    handing it straight to the tenant's first waiter (returned, for the caller to wake);
    :meth:`abandon` takes a waiter that gave up out of the queue."""

    def __init__(self, bound: int) -> None:
        if bound < 1:
            raise ValueError("bound must be >= 1")
        self.bound = bound
        self._in_progress: dict[str, int] = {}
        self._waiting: dict[str, deque[Waiter]] = {}

    def enter(self, tenant_id: str, waiter: Waiter) -> bool:
        """True: in progress now. False: ``waiter`` is queued behind the tenant's others."""
        held = self._in_progress.get(tenant_id, 0)
        if held < self.bound and not self._waiting.get(tenant_id):
            self._in_progress[tenant_id] = held + 1
            return True
        self._waiting.setdefault(tenant_id, deque()).append(waiter)
        return False

    def leave(self, tenant_id: str) -> Waiter | None:
        """A request of the tenant is done: its place goes to the tenant's first waiter
        (returned; it is in progress from now on), or is freed (None)."""
        queue = self._waiting.get(tenant_id)
        if queue:
            waiter = queue.popleft()
            if not queue:
                del self._waiting[tenant_id]
            return waiter
        left = self._in_progress[tenant_id] - 1
        if left:
            self._in_progress[tenant_id] = left
        else:
            del self._in_progress[tenant_id]
        return None

    def abandon(self, tenant_id: str, waiter: Waiter) -> bool:
        """Take a waiter out of the queue (it gave up); False if it is not there (it was
        handed a place already: it must :meth:`leave` as any request in progress)."""
        queue = self._waiting.get(tenant_id)
        if not queue or waiter not in queue:
            return False
        queue.remove(waiter)
        if not queue:
            del self._waiting[tenant_id]
        return True

    def in_progress(self, tenant_id: str) -> int:
        return self._in_progress.get(tenant_id, 0)

    def waiting(self, tenant_id: str) -> int:
        return len(self._waiting.get(tenant_id, ()))

    def refusal(self, waited_s: float) -> TooManyRequestsInProgress:
        """The 429 of a request that waited ``waited_s`` for a place and got none."""
        return TooManyRequestsInProgress(
            f"this tenant already has {self.bound} requests in progress in this API process "
            f"(BACKFILL_TENANT_REQUESTS_IN_PROGRESS, at most {self.bound} at once) and this "
            f"one waited {waited_s:g} s for its turn; retry after the time in Retry-After",
            retry_after_s=RETRY_AFTER_S,
        )
