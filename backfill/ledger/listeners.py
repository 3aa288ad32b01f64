"""Messages of one pub/sub channel as they are published: a node's preemption notices (lease
ids), the models of newly claimable work (``backfill.work_bell``).

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


class ChannelListener:
    """The messages of one channel, as they are published (a node's preempted lease ids)."""

    def __init__(self, pubsub: redis.client.PubSub) -> None:
        self._pubsub = pubsub

    def get(self, timeout: float = 1.0) -> str | None:
        """The next message, or None after ``timeout`` seconds."""
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
            message = self.get(timeout=1.0)
            if message is not None:
                yield message

    def close(self) -> None:
        self._pubsub.close()

    def __enter__(self) -> ChannelListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncChannelListener:
    """The messages of one channel, as they are published (asyncio)."""

    def __init__(self, pubsub: redis.asyncio.client.PubSub) -> None:
        self._pubsub = pubsub

    async def get(self, timeout: float = 1.0) -> str | None:
        """The next message, or None after ``timeout`` seconds."""
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
            message = await self.get(timeout=1.0)
            if message is not None:
                yield message

    async def aclose(self) -> None:
        await self._pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]

    async def __aenter__(self) -> AsyncChannelListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
