"""A total deadline for one blocking HTTP exchange (connect, request, the answer's headers).

httpx's timeouts bound each network operation apart: a receiver that drips a byte every half
second never trips a one-second read timeout and holds a send for as long as it likes (and a
sender's claim past its lease, when a second sender takes the delivery). :class:`Deadline`
hooks httpcore's trace to learn the connection's socket and, once the deadline passes, shuts
it down from a timer thread: the blocked read returns at once and the exchange fails.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType
from typing import Any

_CONNECTED = ("connection.connect_tcp.complete", "connection.connect_unix_socket.complete")


class Deadline:
    """``with Deadline(s) as d:`` around a request sent with ``extensions={"trace":
    d.trace}``; ``d.expired`` says whether it was cut off."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.expired = False
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's trace callback: keeps the connection's socket."""
        if event not in _CONNECTED:
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if not isinstance(sock, socket.socket):
            return
        with self._lock:
            self._sock = sock
            if self.expired:
                _cut(sock)

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._timer.cancel()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            if self._sock is not None:
                _cut(self._sock)


def _cut(sock: socket.socket) -> None:
    # shutdown, not close: it wakes a read blocked in another thread.
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
