"""Completion windows and deadline feasibility.

A batch names how long it may take (``completion_window``: OpenAI's ``"24h"``, or any
duration such as ``"30m"``, ``"72h"``, ``"1h30m"``). At submission Backfill checks that the
window can be met: the work done before it (its tenant's backlog, and what the other tenants
get meanwhile at their shares) plus the batch's own tokens, at the deployment's batch
throughput, must fit in the window. If not, it says which
window would be feasible instead of accepting a promise it cannot keep.

Pure functions only: the caller supplies the backlog, the throughput and the clock.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from backfill.refusals import InvalidRequest

_UNIT_SECONDS = (("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1))
_WINDOW = re.compile(r"(?:(\d{1,6})d)?(?:(\d{1,6})h)?(?:(\d{1,6})m)?(?:(\d{1,6})s)?")

# Earliest feasible windows are offered in round steps, so the suggestion stays feasible a
# little while after it is read and is easy to type back.
_SUGGESTION_STEP_S = 5 * 60


class InvalidWindow(InvalidRequest):
    """A ``completion_window`` that is malformed or outside the allowed bounds."""

    default_code = "invalid_completion_window"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="completion_window")


def parse_window(text: str) -> int:
    """Seconds of a duration like ``"24h"``, ``"30m"``, ``"1h30m"``, ``"2d"``."""
    match = _WINDOW.fullmatch(text.strip().lower()) if text else None
    if match is None or not any(match.groups()):
        raise InvalidWindow(
            f"completion_window {text!r} is not a duration such as '24h', '30m' or '1h30m'"
        )
    return sum(
        int(value) * unit
        for value, (_, unit) in zip(match.groups(), _UNIT_SECONDS, strict=True)
        if value
    )


def format_window(seconds: int) -> str:
    """The canonical spelling of a duration: ``5400 -> "1h30m"``, ``86400 -> "24h"``."""
    if seconds <= 0:
        raise ValueError("a window is a positive number of seconds")
    # Whole days read better in hours up to 72h (OpenAI's "24h", the common "48h", "72h").
    units = _UNIT_SECONDS[1:] if seconds <= 72 * 3600 else _UNIT_SECONDS
    parts = []
    rest = seconds
    for name, unit in units:
        value, rest = divmod(rest, unit)
        if value:
            parts.append(f"{value}{name}")
    return "".join(parts)


def checked_window(text: str, min_s: int, max_s: int) -> int:
    """Seconds of ``text``, refused unless ``min_s <= seconds <= max_s``."""
    seconds = parse_window(text)
    if not min_s <= seconds <= max_s:
        raise InvalidWindow(
            f"completion_window {text!r} must be between {format_window(min_s)} and "
            f"{format_window(max_s)}"
        )
    return seconds


def batch_throughput(configured_tps: float, measured_tps: float | None = None) -> float:
    """Tokens per second the deployment processes for batch work.

    Workers' measured decode rate wins once there is one; the configured figure covers a
    cold start. A measured rate of zero (no node up) is not a rate: it would make every
    deadline infeasible forever, so the configured figure stands in.
    """
    if measured_tps is not None and measured_tps > 0:
        return measured_tps
    return configured_tps


@dataclass(frozen=True, slots=True)
class DeadlinePlan:
    """Whether a batch can finish inside its window, and when it is expected to."""

    feasible: bool
    deadline: datetime
    estimated_completion: datetime
    earliest_window_s: int
    """The shortest window (in round steps) the estimate fits in."""

    @property
    def earliest_window(self) -> str:
        return format_window(self.earliest_window_s)


def plan_deadline(
    now: datetime,
    window_s: int,
    *,
    backlog_tokens: int,
    batch_tokens: int,
    throughput_tps: float,
) -> DeadlinePlan:
    """Whether the batch is done within its window when ``backlog_tokens`` are worked
    through before it is: with fair share, its tenant's own backlog and what the other
    tenants get meanwhile (``fairshare.tokens_until_done``); without, everything queued (a
    safe upper bound: EDF may run it sooner when its deadline is earlier than others')."""
    if throughput_tps <= 0:
        raise ValueError("throughput must be positive")
    needed_s = (max(backlog_tokens, 0) + max(batch_tokens, 0)) / throughput_tps
    estimated = now + timedelta(seconds=needed_s)
    deadline = now + timedelta(seconds=window_s)
    earliest = max(
        _SUGGESTION_STEP_S, math.ceil(needed_s / _SUGGESTION_STEP_S) * _SUGGESTION_STEP_S
    )
    return DeadlinePlan(
        feasible=needed_s <= window_s,
        deadline=deadline,
        estimated_completion=estimated,
        earliest_window_s=earliest,
    )
