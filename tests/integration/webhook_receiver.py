"""A real HTTP endpoint for webhook tests: a server in the test process on a free port that
records every request it gets and answers what the test tells it to."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from devkit.harness import free_port


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes
    path: str

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]


@dataclass
class Receiver:
    """What the endpoint got; ``statuses`` are answered in turn (then ``default_status``);
    while ``hold`` is clear a request waits before it is answered."""

    port: int
    received: list[Received] = field(default_factory=list)
    statuses: list[int] = field(default_factory=list)
    default_status: int = 200
    hold: threading.Event = field(default_factory=threading.Event)
    got_one: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.hold.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/backfill"

    def ids(self) -> list[str]:
        with self.lock:
            return [r.webhook_id for r in self.received]


def _handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length)
            with receiver.lock:
                receiver.received.append(
                    Received({k.lower(): v for k, v in self.headers.items()}, body, self.path)
                )
                status = receiver.statuses.pop(0) if receiver.statuses else None
            receiver.got_one.set()
            receiver.hold.wait(30)
            self.send_response(status or receiver.default_status)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@contextmanager
def listening(receiver: Receiver, tls: ssl.SSLContext | None = None) -> Iterator[Receiver]:
    """The endpoint up on ``receiver.port`` for the block (down, refusing, outside it);
    with ``tls``, it speaks https."""
    server = ThreadingHTTPServer(("127.0.0.1", receiver.port), _handler(receiver))
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.hold.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def new_receiver() -> Receiver:
    return Receiver(free_port())


@contextmanager
def dripping(every_s: float = 0.25, for_s: float = 30.0) -> Iterator[str]:
    """An endpoint that reads a request, then answers one byte every ``every_s`` (at most
    ``for_s`` in all): each read of its answer comes well within any read timeout, the answer
    never within a sender's deadline. Yields its URL."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(65536)
                answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n" + b"x-drip: y\r\n" * 200
                end = time.monotonic() + for_s
                for byte in answer:
                    if stop.is_set() or time.monotonic() > end:
                        return
                    conn.sendall(bytes([byte]))
                    time.sleep(every_s)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                conn, _ = listener.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/hooks/drip"
    finally:
        stop.set()
        listener.close()
        thread.join(5)
