"""Hostile request bodies sent over a raw socket, and what they cost the server.

An HTTP client library sends a whole body before it reads the answer, and hides a
connection the server cut. :func:`post_body` instead writes the request head, waits (if
asked) for an answer that comes before any body byte, then writes the body piece by piece
while watching for an answer, and reports how many body bytes it got to write before the
server answered or stopped reading.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass
class Answer:
    status: int | None
    """None: the server cut the connection before an answer could be read."""
    body: Any = None
    headers: dict[str, str] = field(default_factory=dict)
    sent: int = 0
    """Body bytes written before the answer came or the server stopped reading."""

    @property
    def error(self) -> dict[str, Any]:
        return (self.body or {}).get("error") or {} if isinstance(self.body, dict) else {}


def pieces(total: int, piece: bytes, first: bytes = b"") -> Iterator[bytes]:
    """``first``, then ``piece`` over and over: ``total`` bytes in all (one object reused,
    so the client itself allocates next to nothing)."""
    if first:
        yield first
    left = total - len(first)
    while left > 0:
        yield piece if left >= len(piece) else piece[:left]
        left -= len(piece)


def post_body(
    base_url: str,
    path: str,
    body: Iterator[bytes],
    *,
    headers: dict[str, str] | None = None,
    content_length: int | None = None,
    early_answer_s: float = 0.0,
    timeout_s: float = 60.0,
) -> Answer:
    """POST ``body`` chunked (or with the declared ``content_length``, sent as is)."""
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    chunked = content_length is None
    lines.append("Transfer-Encoding: chunked" if chunked else f"Content-Length: {content_length}")
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        sent = 0
        if not _readable(sock, early_answer_s):
            for piece in body:
                frame = (b"%x\r\n" % len(piece) + piece + b"\r\n") if chunked else piece
                try:
                    sock.sendall(frame)
                except (BrokenPipeError, ConnectionResetError, TimeoutError):
                    break  # the server stopped reading
                sent += len(piece)
                if _readable(sock, 0):
                    break
            else:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    if chunked:
                        sock.sendall(b"0\r\n\r\n")
        try:
            status, got, content = _read_response(sock)
        except (ConnectionResetError, TimeoutError, ValueError):
            return Answer(None, sent=sent)
    try:
        parsed: Any = json.loads(content) if content else None
    except ValueError:
        parsed = content.decode(errors="replace")
    return Answer(status, parsed, got, sent)


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    ready, _, _ = select.select([sock], [], [], timeout_s)
    return bool(ready)


def _read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ValueError("connection closed before an answer")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ", 2)[1])
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        while not rest.endswith(b"0\r\n\r\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, headers, _dechunk(rest)
    length = int(headers.get("content-length", "0"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, headers, rest[:length]


def _dechunk(raw: bytes) -> bytes:
    out = b""
    while raw:
        size_line, _, raw = raw.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += raw[:size]
        raw = raw[size + 2 :]
    return out
