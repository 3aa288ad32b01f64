"""An upload read once: its cheap checks, its cut into stored pieces and its forecast bound in
one pass; and a stored file's lines read back with where each lies.

:class:`UploadScan` reads a batch upload ``scan_bytes`` at a time and refuses it at the first
step that breaks a limit (size, request lines, line length), so memory stays bounded whatever
the file holds. What passes comes out as the pieces to store, each ending at a line's end (a
line lies in one piece: ``backfill.store.bodies`` reads an item's body from there),
and, once every piece is out, the file's bound of forecast tokens
(:func:`backfill.batch_input.forecast_tokens_upper_bound`, recorded on the file so a create
need not read it for that). Full validation comes at creation.
"""

from __future__ import annotations

import io
import math
import queue
import threading
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from backfill.batch_input import (
    CHARS_PER_TOKEN_ESTIMATE,
    MAX_TOKENS_FIELD,
    InputLimits,
    LineSpot,
)
from backfill.refusals import InvalidRequest, PayloadTooLarge, Refusal

UPLOAD_SCAN_BYTES = 64 * 1024
"""Bytes the scan looks at per step. Its memory is one step, the line carried over to the
next (at most ``max_line_bytes``), the piece being gathered, and one object per line of the
step (a step of two-byte lines is 32,768 of them: about 1.5 MB)."""


class UploadScan:
    """One pass over a batch upload read from where ``source`` stands: :meth:`pieces` gives
    what to store, cut at line ends near ``piece_bytes``, and raises at the first step that
    breaks a limit; after it, ``requests`` and :attr:`tokens_bound` describe the file."""

    def __init__(
        self,
        source: BinaryIO,
        limits: InputLimits,
        *,
        piece_bytes: int,
        scan_bytes: int = UPLOAD_SCAN_BYTES,
        room: Refusal | None = None,
        room_bytes: int | None = None,
    ) -> None:
        self.source = source
        # The bytes the tenant may still store, and the refusal past them.
        self.room = room
        self.room_bytes = room_bytes
        self.limits = limits
        self.piece_bytes = piece_bytes
        # A piece ends at the first line end after piece_bytes: steps no longer than that.
        self.scan_bytes = min(scan_bytes, piece_bytes)
        self.size = 0
        self.requests = 0
        self.max_output_tokens = 0
        """The sum of every ``max_tokens``-like number written in the file's lines."""

    @property
    def tokens_bound(self) -> int:
        """An upper bound of the tokens forecasts charge the file (its lines' output budgets,
        and every byte toward the prompt estimate)."""
        return self.max_output_tokens + math.ceil(self.size / CHARS_PER_TOKEN_ESTIMATE)

    def pieces(self) -> Iterator[bytes]:
        limits = self.limits
        lines_before = 0  # complete lines already scanned
        carry = b""
        gathered: list[bytes] = []
        gathered_bytes = 0
        while step := self.source.read(self.scan_bytes):
            self.size += len(step)
            if self.size > limits.max_file_bytes:
                raise PayloadTooLarge(
                    f"file is larger than the limit of {limits.max_file_bytes} bytes",
                    param="file",
                )
            room = self.room
            if room is not None and self.room_bytes is not None and self.size > self.room_bytes:
                raise room
            buffer = carry + step if carry else step
            end = buffer.rfind(b"\n")
            if end < 0:
                carry = buffer
            else:
                lines = buffer.split(b"\n")
                carry = lines.pop()
                if max(map(len, lines)) > limits.max_line_bytes:
                    _check_line_lengths(buffer[:end], lines_before, limits)
                lines_before += len(lines)
                # A blank line strips to nothing (strip returns a line with no blank at
                # either end as it is: no copy).
                self.requests += sum(map(bool, map(bytes.strip, lines)))
                if self.requests > limits.max_lines:
                    raise _too_many_lines(f"more than {limits.max_lines}", limits)
                if buffer.find(b'"max_', 0, end) >= 0:
                    self.max_output_tokens += sum(
                        int(m) for m in MAX_TOKENS_FIELD.findall(buffer, 0, end)
                    )
                gathered.append(buffer[: end + 1])
                gathered_bytes += end + 1
                if gathered_bytes >= self.piece_bytes:
                    yield b"".join(gathered)
                    gathered, gathered_bytes = [], 0
            if len(carry) > limits.max_line_bytes:
                raise _line_too_long(lines_before + 1, f"more than {limits.max_line_bytes}", limits)
        _check_line_lengths(carry, lines_before, limits)
        if carry.strip():
            self.requests += 1
            self.max_output_tokens += sum(int(m) for m in MAX_TOKENS_FIELD.findall(carry))
        if self.requests == 0:
            raise InvalidRequest("file has no request lines", code="empty_file", param="file")
        if self.requests > limits.max_lines:
            raise _too_many_lines(str(self.requests), limits)
        gathered.append(carry)
        last = b"".join(gathered)
        if last:
            yield last


def check_upload(
    content: bytes | BinaryIO, limits: InputLimits, *, scan_bytes: int = UPLOAD_SCAN_BYTES
) -> int:
    """Refuse a batch upload over the size, line-count or line-length limits; returns the
    number of request lines (the checks of :class:`UploadScan`, nothing kept)."""
    source = io.BytesIO(content) if isinstance(content, bytes) else content
    scan = UploadScan(source, limits, piece_bytes=scan_bytes, scan_bytes=scan_bytes)
    for _ in scan.pieces():
        pass
    return scan.requests


def _check_line_lengths(lines: bytes, lines_before: int, limits: InputLimits) -> None:
    """Refuse the first of these newline-separated lines that is over the limit."""
    if len(lines) <= limits.max_line_bytes:
        return
    for offset, raw in enumerate(lines.split(b"\n"), start=1):
        if len(raw) > limits.max_line_bytes:
            raise _line_too_long(lines_before + offset, str(len(raw)), limits)


def _line_too_long(number: int, size: str, limits: InputLimits) -> InvalidRequest:
    return InvalidRequest(
        f"line {number} is {size} bytes; the limit is {limits.max_line_bytes} bytes",
        code="line_too_long",
        param="file",
    )


def _too_many_lines(count: str, limits: InputLimits) -> InvalidRequest:
    return InvalidRequest(
        f"file has {count} request lines; the limit is {limits.max_lines}",
        code="too_many_lines",
        param="file",
    )


def iter_lines(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """The newline-separated lines of a file given piece by piece (as ``bytes.split``
    would give them, the part after the last newline included): one line at a time, so a
    stored file is validated without being held whole."""
    carry = b""
    for piece in pieces:
        buffer = carry + piece
        end = buffer.rfind(b"\n")
        if end < 0:
            carry = buffer
            continue
        yield from buffer[:end].split(b"\n")
        carry = buffer[end + 1 :]
    yield carry


def iter_located_lines(pieces: Iterable[bytes]) -> Iterator[tuple[bytes, LineSpot | None]]:
    """The lines of a file given as its stored pieces in order (``file_chunks.seq`` 0, 1,
    ...), as :func:`iter_lines` gives them, each with where it lies: ``(seq, first byte,
    length)`` when the whole line is in one piece, None when it runs over into the next (a
    file stored before uploads were cut at line ends)."""
    carry = b""
    carry_at: tuple[int, int] | None = (0, 0)  # where ``carry`` starts; None: over pieces
    for seq, piece in enumerate(pieces):
        start = piece.find(b"\n")
        if start < 0:
            carry_at = None if carry else (seq, 0)
            carry += piece
            continue
        yield carry + piece[:start], None if carry else (seq, 0, start)
        end = piece.rfind(b"\n")
        at = start + 1
        if end > start:
            for line in piece[at:end].split(b"\n"):
                yield line, (seq, at, len(line))
                at += len(line) + 1
        carry, carry_at = piece[end + 1 :], (seq, end + 1)
    last = None if carry_at is None or not carry else (carry_at[0], carry_at[1], len(carry))
    yield carry, last


def read_ahead(pieces: Iterator[bytes], depth: int = 2) -> Iterator[bytes]:
    """``pieces`` as they are, fetched up to ``depth`` ahead by a thread of their own, so
    reading a stored file (a query per piece, waiting on Postgres with the GIL released)
    overlaps parsing the piece before. An error while fetching is raised where the piece
    would have come; a consumer that stops early stops the thread at its next piece."""
    ahead: queue.Queue[tuple[bytes | None, BaseException | None]] = queue.Queue(depth)
    stop = threading.Event()

    def hand(item: tuple[bytes | None, BaseException | None]) -> bool:
        """Queue ``item`` unless the consumer has stopped; whether it was queued."""
        while not stop.is_set():
            try:
                ahead.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def fetch() -> None:
        try:
            for piece in pieces:
                if not hand((piece, None)):
                    return
            hand((None, None))
        except BaseException as exc:  # handed to the consumer, raised there
            hand((None, exc))

    thread = threading.Thread(target=fetch, name="read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            piece, error = ahead.get()
            if error is not None:
                raise error
            if piece is None:
                return
            yield piece
    finally:
        stop.set()
