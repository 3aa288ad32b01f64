"""What makes ``bench.protection`` mean the same thing on every machine: the trace's time
stretch sized from the engine's measured speed, the check that interactive alone was not
itself overloaded, and the one verdict that judges TTFT p50, p99 and batch kept together.

A fixed stretch (it was x70) loads a fast engine lightly and drowns a slow one: on an AVX2 CPU
prefilling ~70 tok/s instead of ~1,100, interactive alone queued (TTFT p50 94 s) and every
ratio against it was noise. Here the stretch is the smallest that keeps the engine busy about
``target_busy`` of the window with interactive traffic alone, each request costing what it
costs alone on the measured engine (:meth:`EngineSpeed.seconds_for`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backfill_analysis.simulate.trace import TraceRequest

TARGET_BUSY = 0.3
OVERLOADED_BUSY = 0.6
"""Interactive alone busier than this (twice the target) is queueing, not the load planned."""
OVERLOADED_TTFT_FACTOR = 4.0
"""... and so is a TTFT p50 this many times what the median prompt's prefill takes alone."""
GOAL_TTFT_RATIO = 1.1
GOAL_BATCH_KEPT = 0.6
_SCALE_LO, _SCALE_HI = 1e-4, 1e7


@dataclass(frozen=True)
class Stretch:
    """The time stretch chosen and the load it plans."""

    time_scale: float
    requests: list[TraceRequest]
    """The scaled requests arriving inside the window."""
    planned_busy: float
    """Their seconds-alone over the window: the share of it the engine is planned busy."""
    sized: bool
    """False when the stretch was given, not sized."""


def scaled(
    trace: Sequence[TraceRequest], time_scale: float, duration_s: float
) -> list[TraceRequest]:
    """``trace`` (arrivals in trace seconds from its first request) stretched by ``time_scale``,
    the requests arriving inside ``duration_s``."""
    return [
        TraceRequest(r.arrival_s * time_scale, r.prompt_tokens, r.output_tokens)
        for r in trace
        if r.arrival_s * time_scale < duration_s
    ]


def planned_busy(
    requests: Sequence[TraceRequest], cost_s: Callable[[int, int], float], duration_s: float
) -> float:
    return sum(cost_s(r.prompt_tokens, r.output_tokens) for r in requests) / duration_s


def size_stretch(
    trace: Sequence[TraceRequest],
    cost_s: Callable[[int, int], float],
    duration_s: float,
    *,
    target_busy: float = TARGET_BUSY,
    time_scale: float | None = None,
) -> Stretch:
    """The smallest stretch whose window keeps the engine at most ``target_busy`` busy
    (``cost_s(prompt, output)``: a request's seconds alone on the engine), or ``time_scale``
    when given. A stretch only drops requests as it grows, so the planned load falls
    monotonically and a bisection on its logarithm finds the edge. A trace too light to reach
    the target even compressed into the window is replayed whole, as busy as it gets."""
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")

    def at(scale: float) -> Stretch:
        reqs = scaled(trace, scale, duration_s)
        return Stretch(scale, reqs, planned_busy(reqs, cost_s, duration_s), time_scale is None)

    if time_scale is not None:
        return at(time_scale)
    if not trace:
        return Stretch(1.0, [], 0.0, True)
    span = max(r.arrival_s for r in trace)
    whole = at(duration_s / span * (1 - 1e-9)) if span > 0 else at(1.0)
    if whole.planned_busy <= target_busy:
        return whole
    lo, hi = math.log(_SCALE_LO), math.log(_SCALE_HI)
    if at(math.exp(hi)).planned_busy > target_busy:
        return at(math.exp(hi))  # one request alone is busier than the target
    for _ in range(80):
        mid = (lo + hi) / 2
        if at(math.exp(mid)).planned_busy <= target_busy:
            hi = mid
        else:
            lo = mid
    return at(math.exp(hi))


def busy_share(intervals: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """The share of ``[start, end]`` covered by at least one ``(begin, finish)`` interval: how
    much of the window the engine had an interactive request in it."""
    if end <= start:
        return 0.0
    covered, reach = 0.0, start
    for begin, finish in sorted(intervals):
        lo, hi = max(begin, reach), min(finish, end)
        if hi > lo:
            covered += hi - lo
            reach = hi
    return covered / (end - start)


def overload_reason(
    reached_busy: float | None,
    ttft_p50_s: float | None,
    median_prefill_s: float,
) -> str | None:
    """Why interactive alone was itself overloaded (then no ratio against it means anything),
    or None when it ran as planned."""
    if reached_busy is not None and reached_busy > OVERLOADED_BUSY:
        return (
            f"interactive alone overloaded: the engine was busy {reached_busy:.0%} of the "
            f"window (planned {TARGET_BUSY:.0%}, limit {OVERLOADED_BUSY:.0%})"
        )
    if ttft_p50_s is not None and ttft_p50_s > OVERLOADED_TTFT_FACTOR * median_prefill_s + 0.5:
        return (
            f"interactive alone overloaded: TTFT p50 {ttft_p50_s:.2f} s against "
            f"{median_prefill_s:.2f} s for the median prompt alone"
        )
    return None


@dataclass(frozen=True)
class Verdict:
    """The closing line's figure: the worst of the three goals as a share of its limit
    (TTFT p50 / 1.1, TTFT p99 / 1.1, 0.6 / batch kept), ok at <= 1; with a reason when no
    verdict can be given."""

    worst: float
    ok: bool
    reason: str | None = None


def verdict(
    ttft_p50_ratio: float | None,
    ttft_p99_ratio: float | None,
    batch_kept: float | None,
    overloaded: str | None,
) -> Verdict:
    if overloaded:
        return Verdict(math.nan, False, overloaded)
    missing = [
        name
        for name, v in (
            ("ttft_p50_ratio", ttft_p50_ratio),
            ("ttft_p99_ratio", ttft_p99_ratio),
            ("batch_kept", batch_kept),
        )
        if v is None
    ]
    if missing:
        return Verdict(math.nan, False, f"not measured: {', '.join(missing)}")
    assert ttft_p50_ratio is not None
    assert ttft_p99_ratio is not None
    assert batch_kept is not None
    shares = (
        ttft_p50_ratio / GOAL_TTFT_RATIO,
        ttft_p99_ratio / GOAL_TTFT_RATIO,
        GOAL_BATCH_KEPT / batch_kept if batch_kept > 0 else math.inf,
    )
    worst = max(shares)
    return Verdict(worst, worst <= 1.0)
