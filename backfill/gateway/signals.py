"""This process' interactive activity per node, published to Redis for the workers' work
budgets (``backfill.work_signals``), soon after it changes and often enough to stay fresh
within the signals' TTL while it does not.

Its stamps are on Redis' clock: the workers that read them run on other hosts, whose clocks
may disagree with this one (``host_clock``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

from backfill.cancelling import cancel_and_wait
from backfill.clock import HostClock, SharedClock, redis_time
from backfill.ledger import SignalRedis
from backfill.work_signals import InteractiveActivity, publish_signals

log = logging.getLogger("backfill.gateway")


class SignalPublisher:
    """The activity of one gateway process and the task that publishes it."""

    def __init__(
        self,
        ledger: SignalRedis,
        *,
        ttl_s: float,
        budget_interval_s: float,
        host_clock: HostClock = time.time,
    ) -> None:
        self._ledger = ledger
        self._ttl_s = ttl_s
        self._interval_s = min(0.1, budget_interval_s / 2)
        self.clock = SharedClock(host=host_clock)
        self.activity = InteractiveActivity(clock=self.clock.now)
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._publisher: asyncio.Task[None] | None = None

    async def _publish(self) -> None:
        ttl = self._ttl_s
        version, published_at = -1, 0.0
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                now = await self.clock.refresh(redis_time(self._ledger.client))
            except Exception as exc:  # go on from the last anchor
                log.debug("Redis' clock not read: %s", exc)
                now = self.clock.now()
            if self.activity.version == version and now - published_at < ttl / 3:
                continue
            version = self.activity.version
            try:
                await publish_signals(
                    self._ledger.client,
                    self._ledger.keys,
                    self.gateway_id,
                    self.activity.snapshot(keep_s=ttl),
                    ttl,
                    now,
                )
                published_at = now
            except Exception as exc:  # batch then judges by the engine's queue alone
                log.warning("interactive signals not published: %s", exc)

    async def start(self) -> None:
        """Publish from now on; the first time, anchor the clock the stamps are written on
        (one round trip to Redis, once per process)."""
        if not self.clock.anchored:
            try:
                await self.clock.sync(redis_time(self._ledger.client))
            except Exception as exc:  # the publisher tries again
                log.warning("Redis' clock not read: %s", exc)
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.get_running_loop().create_task(self._publish())

    async def aclose(self) -> None:
        if self._publisher is not None:
            await cancel_and_wait([self._publisher])  # again if a cancellation was lost
