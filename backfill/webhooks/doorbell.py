"""The sender's doorbell: Postgres tells an idle sender at once that deliveries were queued.

The transaction that ends a batch and queues its deliveries also sends ``NOTIFY
backfill_webhooks`` (:data:`CHANNEL`; Postgres delivers it when, and only if, that transaction
commits). A sender listens on a connection of its own, on a thread, and rings: the sender's
loop waits on :meth:`Doorbell.rung` beside its sends in flight and claims at once, instead of
at its next poll (``BACKFILL_WEBHOOKS_POLL_S``, which stays: it finds retries that come due,
and anything queued while the listening connection was down). A lost connection is opened
again after a pause; nothing depends on the bell but how soon a delivery starts.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import psycopg

CHANNEL = "backfill_webhooks"
RECONNECT_S = 5.0
"""How long a doorbell waits before it listens again after its connection failed."""

log = logging.getLogger("backfill.webhooks")


class Doorbell:
    """Listens for :data:`CHANNEL` on a thread of its own until :meth:`close`."""

    def __init__(self, conninfo: str) -> None:
        self._conninfo = conninfo
        self._lock = threading.Lock()
        self._rung: Future[None] = Future()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="webhook-doorbell", daemon=True)
        self._thread.start()

    def rung(self) -> Future[None]:
        """A future done once the bell has rung (since the last one was taken): wait on it
        beside other futures."""
        with self._lock:
            if self._rung.done():
                self._rung = Future()
            return self._rung

    def ring(self) -> None:
        with self._lock:
            if not self._rung.done():
                self._rung.set_result(None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    # Whatever was queued while nobody listened: the sender looks now.
                    self.ring()
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=1.0, stop_after=1):
                            self.ring()
            except psycopg.Error as exc:
                log.warning("webhook doorbell: %s; listening again in %.0f s", exc, RECONNECT_S)
                self._stop.wait(RECONNECT_S)
