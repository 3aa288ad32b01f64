"""API key -> tenant, remembered for a few seconds so a hot path skips a Postgres round trip.

Both answers are remembered, by the key's digest (the key itself is not kept): a found tenant,
and a key that matched no live key (a client retrying a wrong key, or anyone guessing, costs
one Postgres lookup per TTL, not one per request). A new key cannot have been looked up
before it existed, so remembering misses never delays one.

Revocation is announced on a Redis channel (:func:`announce_revocation`); every API process
listens (:class:`RevocationListener`) and evicts the key at once. A process that loses its
subscription forgets everything it remembered when it gets it back (it may have missed an
announcement), so only while it is cut off from Redis may a revoked key work, for at most
the TTL.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import redis

from backfill.keys import key_revocations_channel
from backfill.redis_client import SyncRedis
from backfill.store import TenantRecord, key_digest

log = logging.getLogger(__name__)


class TenantKeyCache:
    def __init__(
        self,
        lookup: Callable[[str], TenantRecord | None],
        ttl_s: float,
        *,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lookup = lookup
        self._ttl = ttl_s
        self._max = max_entries
        self._clock = clock
        # digest -> (expires at, tenant or None for a key that matched nothing)
        self._entries: OrderedDict[str, tuple[float, TenantRecord | None]] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, key: str) -> tuple[bool, TenantRecord | None]:
        """``(known, tenant)`` from memory alone: ``known`` is False when only Postgres can
        tell (the caller may want to charge for that lookup first)."""
        if self._ttl <= 0:
            return False, None
        digest = key_digest(key)
        with self._lock:
            hit = self._entries.get(digest)
            if hit is not None and hit[0] > self._clock():
                return True, hit[1]
        return False, None

    def get(self, key: str) -> TenantRecord | None:
        known, tenant = self.cached(key)
        if known:
            return tenant
        now = self._clock()
        tenant = self._lookup(key)
        if self._ttl > 0:
            digest = key_digest(key)
            with self._lock:
                self._entries[digest] = (now + self._ttl, tenant)
                self._entries.move_to_end(digest)
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
        return tenant

    def evict(self, digest: str) -> None:
        """Forget one key (by digest): its next use is checked in Postgres."""
        with self._lock:
            self._entries.pop(digest, None)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


def announce_revocation(client: SyncRedis, namespace: str, digests: list[str]) -> int:
    """Tell every listening API process to forget these keys; returns how many listened.
    Raises ``redis.RedisError`` when Redis cannot be reached (the caller says what that
    means: the keys then stop working within the cache TTL)."""
    channel = key_revocations_channel(namespace)
    listeners = 0
    for digest in digests:
        listeners = int(client.publish(channel, digest))
    return listeners


class RevocationListener:
    """A daemon thread that evicts revoked keys from ``cache`` as they are announced."""

    def __init__(
        self,
        client: SyncRedis,
        namespace: str,
        cache: TenantKeyCache,
        *,
        retry_s: float = 1.0,
    ) -> None:
        self._client = client
        self._channel = key_revocations_channel(namespace)
        self._cache = cache
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="key-revocations", daemon=True)
        self.subscribed = threading.Event()
        """Set while the subscription is live (tests wait for it)."""

    def start(self) -> RevocationListener:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
            try:
                pubsub.subscribe(self._channel)
                # An announcement may have been missed before (or between) subscriptions.
                self._cache.clear()
                self.subscribed.set()
                while not self._stop.is_set():
                    message: Any = pubsub.get_message(timeout=0.5)
                    if message is not None and message.get("type") == "message":
                        data = message["data"]
                        self._cache.evict(data.decode() if isinstance(data, bytes) else data)
            except (redis.RedisError, OSError) as exc:
                if not self._stop.is_set():
                    log.warning("key revocations not heard (Redis: %s); retrying", exc)
            finally:
                self.subscribed.clear()
                with contextlib.suppress(redis.RedisError, OSError):
                    pubsub.close()
            self._stop.wait(self._retry_s)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
