"""How many uploads and batch creates one API process works on at once: per tenant and in
all. Each holds a Postgres connection for as long as it checks and stores a file; without a
bound, one tenant's flood of creates took every connection of the API's pool and every other
tenant's reads waited 30 s for one, then failed. Beyond a bound the answer is a 429 at once,
with ``Retry-After``, before any work."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from backfill.refusals import RateLimited

RETRY_AFTER_S = 1.0


class TooManyIngests(RateLimited):
    default_code = "too_many_concurrent_ingests"


class IngestSlots:
    """``per_tenant`` uploads and creates of one tenant at once, ``total`` of all tenants."""

    def __init__(self, per_tenant: int, total: int) -> None:
        if per_tenant < 1 or total < 1:
            raise ValueError("per_tenant and total must be >= 1")
        self.per_tenant = per_tenant
        self.total = total
        self._held: dict[str, int] = {}
        self._in_all = 0
        self._lock = threading.Lock()

    @contextmanager
    def held(self, tenant_id: str) -> Iterator[None]:
        """A slot for the block, or :class:`TooManyIngests` at once."""
        with self._lock:
            mine = self._held.get(tenant_id, 0)
            if mine >= self.per_tenant:
                raise TooManyIngests(
                    f"this tenant already has {mine} file uploads or batch creates being "
                    f"processed (at most {self.per_tenant} at once); retry after the time in "
                    "Retry-After",
                    retry_after_s=RETRY_AFTER_S,
                )
            if self._in_all >= self.total:
                raise TooManyIngests(
                    f"the API is processing {self._in_all} file uploads and batch creates, its "
                    "most at once; retry after the time in Retry-After",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._held[tenant_id] = mine + 1
            self._in_all += 1
        try:
            yield
        finally:
            with self._lock:
                left = self._held[tenant_id] - 1
                if left:
                    self._held[tenant_id] = left
                else:
                    del self._held[tenant_id]
                self._in_all -= 1

    def in_use(self, tenant_id: str | None = None) -> int:
        with self._lock:
            return self._in_all if tenant_id is None else self._held.get(tenant_id, 0)
