"""The ids a source has yielded so far, kept in 21 to 43 bytes a row, whatever their length.

A reader refuses a repeated document id, so it remembers every id it has seen: a Python set
of strings costs ~110 bytes a row (the string and its slot), 1.7 GB for a 10 GB Parquet file
of 7 million short documents. This table keeps a 16-byte BLAKE2b digest of each id in an
open-addressed ``bytearray``, at most three quarters full: two different ids share a digest with
probability ~n²/2¹²⁹ (below 10⁻²⁵ at a billion rows), so the answer is the set's.
"""

from __future__ import annotations

from hashlib import blake2b

DIGEST = 16
"""Bytes kept a row."""
EMPTY = bytes(DIGEST)


def _digest(key: str) -> bytes:
    d = bytearray(blake2b(key.encode("utf-8", "surrogatepass"), digest_size=DIGEST).digest())
    d[0] |= 1  # never all zeros: that marks an empty slot
    return bytes(d)


class SeenIds:
    """Ids seen so far: :meth:`add` tells whether an id is new, and remembers it."""

    __slots__ = ("_count", "_mask", "_slots")

    def __init__(self, capacity: int = 1024) -> None:
        size = 1
        while 3 * size < 4 * capacity:
            size *= 2
        self._slots = bytearray(size * DIGEST)
        self._mask = size - 1
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, key: str) -> bool:
        """True when ``key`` was not seen before (it is now); False for a repeat."""
        digest = _digest(key)
        if not self._place(digest):
            return False
        self._count += 1
        if 4 * self._count > 3 * (self._mask + 1):
            self._grow()
        return True

    def _place(self, digest: bytes) -> bool:
        slots, mask = self._slots, self._mask
        i = int.from_bytes(digest[8:], "little") & mask
        while True:
            at = i * DIGEST
            held = slots[at : at + DIGEST]
            if held == EMPTY:
                slots[at : at + DIGEST] = digest
                return True
            if held == digest:
                return False
            i = (i + 1) & mask

    def _grow(self) -> None:
        old = self._slots
        self._slots = bytearray(2 * len(old))
        self._mask = 2 * (self._mask + 1) - 1
        for at in range(0, len(old), DIGEST):
            digest = bytes(old[at : at + DIGEST])
            if digest != EMPTY:
                self._place(digest)
