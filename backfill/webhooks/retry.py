"""When a delivery is tried again, and when it is given up: pure decisions, no I/O.

After the n-th failed attempt the next waits ``base x 2^(n-1)`` seconds, capped at
``max_delay``, with jitter (between half and all of it, so endpoints that failed together do
not come back together). A delivery whose next attempt would fall later than ``retry_for``
after its event is failed instead. A 2xx answer delivers; anything else (another status, a
refused connection, a timeout, a target that no longer passes its check) is a failed attempt.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class DeliveryState(StrEnum):
    """Where one event's delivery to one endpoint stands."""

    PENDING = "pending"
    """Not delivered yet: due at ``next_attempt_at`` (or being tried now)."""
    DELIVERED = "delivered"
    """The endpoint answered 2xx."""
    FAILED = "failed"
    """Every attempt within the retry period failed; no more are made."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    base_s: float = 5.0
    max_delay_s: float = 3600.0
    retry_for_s: float = 24 * 3600.0

    def delay_s(self, failed_attempts: int, jitter: float) -> float:
        """The wait after ``failed_attempts`` (>= 1) failures; ``jitter`` in [0, 1)."""
        exponent = min(max(failed_attempts - 1, 0), 62)
        full = min(self.max_delay_s, self.base_s * 2.0**exponent)
        return full * (0.5 + 0.5 * jitter)

    def schedule(self, jitter: float = 1.0) -> list[float]:
        """Every attempt's time after the event (0 first) until the delivery is given up."""
        at, times, n = 0.0, [0.0], 1
        while True:
            at += self.delay_s(n, jitter)
            if at > self.retry_for_s:
                return times
            times.append(at)
            n += 1


@dataclass(frozen=True, slots=True)
class AttemptResult:
    """What one send came to: the status the endpoint answered, or the error that stopped it."""

    status_code: int | None = None
    error: str | None = None

    @property
    def delivered(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


@dataclass(frozen=True, slots=True)
class AfterAttempt:
    """The delivery's state after an attempt, and when the next is due (pending only)."""

    state: DeliveryState
    retry_in_s: float | None = None


def after_attempt(
    result: AttemptResult,
    *,
    attempts: int,
    age_s: float,
    policy: RetryPolicy,
    jitter: float,
) -> AfterAttempt:
    """``attempts`` made so far (this one included); ``age_s`` since the event."""
    if result.delivered:
        return AfterAttempt(DeliveryState.DELIVERED)
    delay = policy.delay_s(attempts, jitter)
    if age_s + delay > policy.retry_for_s:
        return AfterAttempt(DeliveryState.FAILED)
    return AfterAttempt(DeliveryState.PENDING, delay)
