"""Rate credits: a tenant's requests taken from its bucket in Redis a few at a time, and spent
in-process, so most requests of a busy tenant pass the rate limit without a round trip.

A process asks the bucket for up to ``take`` tokens at once (at least the request's cost); it
spends what it got on the tenant's next requests for at most ``hold_s``, and hands back what
is left unspent with its next ask (the bucket is capped at its burst, as always). The tenant's
rate over all processes stays bounded by the one bucket: a process only spends tokens the
bucket gave it. What may differ from one round trip per request, whatever ``hold_s``: a
process holds at most ``max_take - 1`` of a tenant's tokens, so over any stretch of ``T``
seconds the tenant gets at most ``burst + rate x T + P x (max_take - 1)`` requests through
``P`` processes (at most a tenth of the burst more per process), and while a process holds
them another process sees that many fewer in the bucket. The hold only says how long a
process may spend what it took: long enough that a tenant sending a request every second
pays a round trip on a fraction of them (5 s: about a fifth; every half second: a tenth).

``take`` adapts to the tenant's pace in this process: it doubles while the credits run out
before their time (up to ``max_take``), and halves when they go unspent, so a quiet tenant
takes one token per request, as without credits. Pure bookkeeping, no I/O:
:class:`backfill.ratelimit.RateLimiter` does the asking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_TENANTS = 10_000
"""Tenants whose credits one process remembers; past it, expired entries are dropped."""


def max_take(rate_per_s: float, burst: int, hold_s: float) -> int:
    """The most tokens one ask takes: what the tenant's rate refills in ``hold_s``, at most a
    tenth of its burst, at least 1 (1 is exactly one round trip per request)."""
    return max(1, min(burst // 10, math.ceil(rate_per_s * hold_s)))


@dataclass(slots=True)
class _Credits:
    left: int
    until: float
    take: int


@dataclass(frozen=True, slots=True)
class Ask:
    """What to ask the bucket for: ``take`` tokens at most, ``refund`` handed back."""

    take: int
    refund: int


class CreditBook:
    """One process's credits, per tenant."""

    def __init__(self, max_take: int, hold_s: float) -> None:
        if max_take < 1 or hold_s <= 0:
            raise ValueError("max_take must be >= 1 and hold_s > 0")
        self.max_take = max_take
        self.hold_s = hold_s
        self._credits: dict[str, _Credits] = {}

    def spend(self, tenant_id: str, cost: int, now: float) -> bool:
        """Whether credits in hand pay for this request (and they are spent)."""
        credits = self._credits.get(tenant_id)
        if credits is None or now >= credits.until or credits.left < cost:
            return False
        credits.left -= cost
        return True

    def ask(self, tenant_id: str, cost: int, now: float) -> Ask:
        """What to ask the bucket for, the credits in hand being too few or too old."""
        credits = self._credits.get(tenant_id)
        if credits is None:
            return Ask(take=cost, refund=0)
        if now >= credits.until and credits.left > 0:
            take = max(1, credits.take // 2)  # unspent in time: the tenant is slower
        else:
            take = min(self.max_take, credits.take * 2)  # ran out in time: it is faster
        return Ask(take=max(cost, take), refund=credits.left)

    def got(self, tenant_id: str, ask: Ask, granted: int, cost: int, now: float) -> None:
        """The bucket's answer to ``ask``: ``granted`` tokens (0 when refused); the refund
        went back either way."""
        if len(self._credits) >= MAX_TENANTS and tenant_id not in self._credits:
            self._forget_expired(now)
        self._credits[tenant_id] = _Credits(
            left=max(0, granted - cost), until=now + self.hold_s, take=ask.take
        )

    def _forget_expired(self, now: float) -> None:
        for tenant_id in [t for t, c in self._credits.items() if now >= c.until]:
            del self._credits[tenant_id]
