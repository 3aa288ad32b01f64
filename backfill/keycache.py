"""API key -> tenant, remembered for a few seconds so a hot path skips a Postgres round trip.

Only found tenants are remembered (a new key works at once; a wrong key is always checked), by
the key's digest (the key itself is not kept). A revoked key stops working within the TTL.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from backfill.repository import TenantRecord, key_digest


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
        self._entries: OrderedDict[str, tuple[float, TenantRecord]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> TenantRecord | None:
        if self._ttl <= 0:
            return self._lookup(key)
        digest = key_digest(key)
        now = self._clock()
        with self._lock:
            hit = self._entries.get(digest)
            if hit is not None and hit[0] > now:
                return hit[1]
        tenant = self._lookup(key)
        if tenant is not None:
            with self._lock:
                self._entries[digest] = (now + self._ttl, tenant)
                self._entries.move_to_end(digest)
                while len(self._entries) > self._max:
                    self._entries.popitem(last=False)
        return tenant
