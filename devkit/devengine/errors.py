"""How the development engine reports: its error type and its progress lines."""

from __future__ import annotations

import sys

from backfill.errors import BackfillError


class DevEngineError(BackfillError):
    """Provisioning or running the development engine failed; the message says which step and
    carries the tail of the step's output."""


def say(message: str) -> None:
    print(f"[devengine] {message}", file=sys.stderr, flush=True)


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])
