"""One clock for every time that crosses machines.

A gateway, a worker and the API run on different hosts, and host clocks disagree (an NTP
daemon that is off, a VM resumed from a snapshot, a container on a host with no time sync at
all). A stamp one host writes and another compares with its own ``time.time()`` is then off
by the difference: a minute of skew made every gateway signal stale (or fresh forever), every
pending interactive request a minute old, and every deadline a minute nearer or farther.

So Backfill compares times of different machines on one clock only:

- **Postgres'** ``now()`` for everything stored there (deadlines, ``not_before``, lease
  expiries, ``created_at``): the repository computes such times in SQL (``now() +
  make_interval(...)``) and hands back durations (seconds left), never a host's timestamp;
  where a process needs the time itself (a batch's deadline, its progress), it reads
  ``Repository.now()``, a :class:`SharedClock` on Postgres' clock.
- **Redis'** ``TIME`` for the stamps kept in Redis (the ledger's scripts read it themselves;
  the work budget's signals and published budgets carry :class:`SharedClock` time).

A :class:`SharedClock` reads Redis' clock from here without a round trip per reading: it
anchors on one ``TIME`` reply (taken at the midpoint of the round trip) and advances by this
host's monotonic clock, re-anchoring every ``refresh_s``. Between anchors its error is the
round trip's half (well under a millisecond on a LAN) plus monotonic drift (NTP-slewed, so
parts per million); it never depends on this host's wall clock, which may also jump.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from backfill.redis_client import AsyncRedis, SyncRedis

HostClock = Callable[[], float]
"""This host's wall clock, seconds since the epoch (``time.time``). Injectable so a test can
run a process whose clock is off."""

REFRESH_S = 10.0
"""How often a :class:`SharedClock` re-anchors on the reference clock by default."""

POOR_FACTOR = 4.0
"""A reading whose round trip is this many times the anchor's (and over ``POOR_FLOOR_S`` each
way) is a poor one, even when a new anchor is due: a stalled event loop that resumes late
lengthens the round trip and places the reading late, setting the clock back by up to half the
stall. The anchor it would replace stays (the monotonic clock drifts parts per million), until
it is ``STALE_AFTER`` refresh intervals old."""
POOR_FLOOR_S = 0.005
STALE_AFTER = 6


def _seconds(reply: tuple[int, int] | list[int] | tuple[bytes, bytes]) -> float:
    """``TIME``'s ``(seconds, microseconds)`` reply as float seconds."""
    secs, micros = reply
    return int(secs) + int(micros) / 1_000_000


class SharedClock:
    """A reference clock on another machine (Redis'), read on this one.

    Before its first anchor it reads this host's clock (a process that has not reached the
    reference yet has no other); :attr:`anchored` tells which. Readings are safe from any
    thread (an anchor is replaced whole); concurrent syncs only race to set the newest.
    """

    def __init__(
        self,
        *,
        refresh_s: float = REFRESH_S,
        host: HostClock = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refresh_s = refresh_s
        self._host = host
        self._monotonic = monotonic
        # (reference seconds, monotonic seconds at that reading, half its round trip)
        self._anchor: tuple[float, float, float] | None = None
        # When a poor reading was last turned down (the next try waits a refresh interval).
        self._declined_mono_s = -float("inf")

    @property
    def anchored(self) -> bool:
        return self._anchor is not None

    @property
    def uncertainty_s(self) -> float:
        """Half the round trip of the last anchor: how far off a reading may be."""
        anchor = self._anchor
        return float("inf") if anchor is None else anchor[2]

    def now(self) -> float:
        """Seconds since the epoch on the reference clock."""
        anchor = self._anchor
        if anchor is None:
            return self._host()
        return anchor[0] + (self._monotonic() - anchor[1])

    def offset_s(self) -> float:
        """The reference clock minus this host's wall clock (what this host is behind by)."""
        return self.now() - self._host()

    def due(self) -> bool:
        anchor = self._anchor
        if anchor is None:
            return True
        return self._monotonic() - max(anchor[1], self._declined_mono_s) >= self.refresh_s

    def anchor(self, reference_s: float, sent_mono_s: float, received_mono_s: float) -> None:
        """Take one reading of the reference clock, asked at ``sent_mono_s`` and answered at
        ``received_mono_s`` (this host's monotonic clock): the reading is placed at the
        midpoint. A reading with a longer round trip than the current anchor's, taken within
        the refresh interval, is ignored (a slow reply is a poor anchor); so is a poor one
        (``POOR_FACTOR``) after it, until the anchor is ``STALE_AFTER`` intervals old."""
        half = max(0.0, received_mono_s - sent_mono_s) / 2
        current = self._anchor
        if current is not None:
            age = received_mono_s - current[1]
            if age < self.refresh_s and half > current[2]:
                return
            poor = half > max(POOR_FACTOR * current[2], POOR_FLOOR_S)
            if poor and age < STALE_AFTER * self.refresh_s:
                self._declined_mono_s = received_mono_s
                return
        self._anchor = (reference_s, sent_mono_s + half, half)

    async def sync(self, read: Callable[[], Awaitable[float]]) -> None:
        """Anchor on one reading of the reference clock (``read``: e.g. :func:`redis_time`)."""
        sent = self._monotonic()
        reference = await read()
        self.anchor(reference, sent, self._monotonic())

    def sync_blocking(self, read: Callable[[], float]) -> None:
        sent = self._monotonic()
        reference = read()
        self.anchor(reference, sent, self._monotonic())

    async def refresh(self, read: Callable[[], Awaitable[float]]) -> float:
        """Re-anchor if due, then read: the call for loops that run every fraction of a
        second (one ``TIME`` round trip per ``refresh_s``, the rest local)."""
        if self.due():
            await self.sync(read)
        return self.now()

    def refresh_blocking(self, read: Callable[[], float]) -> float:
        if self.due():
            self.sync_blocking(read)
        return self.now()


def redis_time(client: AsyncRedis) -> Callable[[], Awaitable[float]]:
    """A reader of Redis' clock for :meth:`SharedClock.sync`."""

    async def read() -> float:
        return _seconds(await client.time())

    return read


def redis_time_blocking(client: SyncRedis) -> Callable[[], float]:
    def read() -> float:
        return _seconds(client.time())

    return read
