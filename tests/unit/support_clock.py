"""A clock the unit tests move by hand."""

from __future__ import annotations


class HandClock:
    """Reads ``now``, which a test sets to move time on."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
