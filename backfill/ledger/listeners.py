"""Preemption notices as they are published: one subscription to one node's channel.

Preemption reaches a holder twice: as a pub/sub notice here, and, should the notice be lost,
as the status of its next heartbeat (so a lost notice delays an abort, never skips it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator

import redis
import redis.asyncio

from backfill.ledger.calls import decoded
from backfill.ledger.steps import REDIS_ERRORS, translate


class PreemptionListener:
    """Lease ids preempted on one node, as they are published."""

    def __init__(self, pubsub: redis.client.PubSub) -> None:
        self._pubsub = pubsub

    def get(self, timeout: float = 1.0) -> str | None:
        """The next preempted lease id, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                # get_message answers None for a subscribe confirmation too: wait on.
                message = self._pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if message is not None:
                    return decoded(message["data"])
                if time.monotonic() >= deadline:
                    return None
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc

    def __iter__(self) -> Iterator[str]:
        while True:
            lease_id = self.get(timeout=1.0)
            if lease_id is not None:
                yield lease_id

    def close(self) -> None:
        self._pubsub.close()

    def __enter__(self) -> PreemptionListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPreemptionListener:
    """Lease ids preempted on one node, as they are published (asyncio)."""

    def __init__(self, pubsub: redis.asyncio.client.PubSub) -> None:
        self._pubsub = pubsub

    async def get(self, timeout: float = 1.0) -> str | None:
        """The next preempted lease id, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                message = await self._pubsub.get_message(
                    ignore_subscribe_messages=True, timeout=max(0.0, deadline - time.monotonic())
                )
                if message is not None:
                    return decoded(message["data"])
                if time.monotonic() >= deadline:
                    return None
        except REDIS_ERRORS as exc:
            raise translate(exc) from exc

    async def __aiter__(self) -> AsyncIterator[str]:
        while True:
            lease_id = await self.get(timeout=1.0)
            if lease_id is not None:
                yield lease_id

    async def aclose(self) -> None:
        await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    async def __aenter__(self) -> AsyncPreemptionListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
