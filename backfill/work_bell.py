"""The bell rung when a job's items become claimable: its model, published on the ledger's
Redis (``{ns}:claimable``), so the idle dispatchers of that model claim now instead of at their
next idle poll (``DispatchConfig.idle_poll_s``).

Each job's first claim came up to a poll after its items were stored, and its prefix pass
(issue 36) a poll after that: ``bench.prefix`` measured the pass starting ~0.5 s after the job
went in progress, and every map and reduce batch of a summary job (issue 37) paid it again.
Preemption notices already travel this way (``{ns}:preempt:{node}``).

A ring is a hint, never a duty: it is sent after the items' transaction has committed, and a
ring lost (Redis away, a dispatcher between subscriptions) costs what no ring did, a poll.
It never raises, and a Redis that cannot be reached is tried again only after
:data:`RETRY_AFTER_S`, so an ingest never waits on it twice in a row.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from backfill.keys import LedgerKeys
from backfill.redis_client import AsyncRedis, SyncRedis, connect

log = logging.getLogger("backfill.ingest")

RING_TIMEOUT_S = 0.5
"""How long a ring may wait on Redis (connect or publish): a hint is not worth more."""

RETRY_AFTER_S = 30.0
"""After a ring fails, how long the bell stays silent before it tries Redis again."""


class WorkBell:
    """Rings the claimable channel of one Redis and namespace; safe from any thread. The
    client is made at the first ring (a process that never rings never connects)."""

    def __init__(self, url: str, namespace: str) -> None:
        self._url = url
        self._channel = LedgerKeys(namespace).claimable_channel()
        self._client: SyncRedis | None = None
        self._silent_until = 0.0
        self._lock = threading.Lock()

    def ring(self, model: str | None) -> int:
        """Say that work for ``model`` (None: for any model) just became claimable; returns
        how many dispatchers heard it (0 when the ring failed or the bell is silent)."""
        now = time.monotonic()
        if now < self._silent_until:
            return 0
        try:
            return int(self._connected().publish(self._channel, model or ""))
        except (redis.RedisError, OSError) as exc:
            self._silent_until = now + RETRY_AFTER_S
            log.warning("work bell: not rung (%s); dispatchers find the work at their poll", exc)
            return 0

    def _connected(self) -> SyncRedis:
        with self._lock:
            if self._client is None:
                self._client = connect(
                    self._url,
                    socket_timeout=RING_TIMEOUT_S,
                    socket_connect_timeout=RING_TIMEOUT_S,
                )
            return self._client

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None


_bells: dict[tuple[str, str], WorkBell] = {}
_bells_lock = threading.Lock()


def work_bell(url: str, namespace: str) -> WorkBell:
    """This process' bell for ``url`` and ``namespace`` (one client each, made once)."""
    with _bells_lock:
        bell = _bells.get((url, namespace))
        if bell is None:
            bell = _bells[(url, namespace)] = WorkBell(url, namespace)
        return bell


def rung_for(model: str | None, wanted: str) -> bool:
    """Whether a ring for ``model`` concerns a dispatcher of model ``wanted`` ("" is any)."""
    return not model or model == wanted


async def ring_from(client: AsyncRedis, keys: LedgerKeys, model: str) -> None:
    """Ring on an asyncio client the caller holds (a dispatcher's ledger: its prefix pass
    over a job ended, whose items other nodes' claims left for it). Never raises."""
    try:
        await client.publish(keys.claimable_channel(), model)
    except (redis.RedisError, OSError) as exc:
        log.debug("work bell: not rung (%s)", exc)
