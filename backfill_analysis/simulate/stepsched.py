"""The step-shaping scheduler's settings and its pure sizing rules (policy ``backfill-step``).

Backfill's engine scheduler class decides inside the engine which tokens each step carries:
while any interactive request waits or still prefills, batch gets no new prefill tokens and its
decoding sequences are *paused* (resident with their KV blocks and computed tokens, carrying no
tokens; nothing is aborted or recomputed); batch prefill is capped per step so an arriving
interactive request waits at most one short step; a starvation bound keeps paused batch moving;
and when KV blocks run short for interactive work, batch gives them up first. The simulated
engine (:mod:`backfill_analysis.simulate.engine`) carries these rules out in its step loop;
this module holds the settings and the arithmetic that sizes them from the step-time model, which
the real scheduler fits from measured step times and the simulator knows exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from backfill_analysis.simulate.costmodel import CostModel

IdleRule = Callable[[float, float], bool]
"""The engine class's idle-ready rule, ``backfill_vllm.policy.idle_ready(window_s,
interactive_quiet_s)``: handed in by whoever runs the simulator from
a checkout (``bench.gpu_steps``), so the simulated engine runs the rule the engine runs, not a
copy (the engine class is a wheel of its own, not installed beside this package)."""


@dataclass(frozen=True)
class StepSchedule:
    """The settings of ``backfill-step``."""

    ride_along_share: float = 0.0
    """While interactive work is pending, batch decode tokens may still ride along in a step
    up to this share of the step's time without them (priced by the step-time model): 0, the
    default, pauses every batch sequence; 0.25 lets batch lengthen such a step by a quarter."""
    chunk_target_s: float = 0.01
    """Batch prefill a step may carry, in step time (marginal, priced by the model): bounds how
    long an interactive request arriving mid-step waits for the step in flight."""
    starvation_steps: int = 0
    """A paused batch sequence carries a token (or gets a prefill chunk) at least once every
    this many steps; 0: no bound in steps."""
    starvation_s: float = 1.0
    """... and within this long of its last progress: it progresses in the last step expected
    to end inside the bound (a step priced as the one before it); 0: no bound in seconds."""
    interactive_likely_s: float = 0.0
    """The whole-step bound (``BACKFILL_SCHED_INTERACTIVE_LIKELY_S``): while interactive work
    runs and for this long after, batch decodes and prefill together add at most the chunk
    target to a step (half under async scheduling), decoders in turns, oldest progress first;
    0 (the simulator's default, as before the bound): only batch prefill is capped."""
    ahead_while_likely: bool = False
    """Under async scheduling, whether a step is still scheduled ahead of the one in flight
    while interactive work is likely (the whole-step bound's window) but none is in the engine
    (``BACKFILL_SCHED_AHEAD_WHILE_LIKELY``). False: such a batch-only step waits for the one in
    flight, so an arrival waits for that step alone, as under sync scheduling, and the device
    idles for the host's share of the next step (``EngineConfig.host_gap_s``), as the engine
    class's default; True: every step is scheduled ahead, as vLLM does. Only with async
    scheduling and a whole-step window (``interactive_likely_s`` > 0)."""

    lift_cap_after_s: float = 0.0
    """The lift (``BACKFILL_SCHED_LIFT_CAP_AFTER_S``): with no interactive work in the engine
    for this long, batch prefill is no longer capped, up to ``lifted_step_target_s`` of step
    time (0 there: vLLM's whole token budget). 0 (the simulator's default): always capped."""
    lifted_step_target_s: float = 0.0
    """How far a lift goes (``BACKFILL_SCHED_LIFTED_STEP_TARGET_S``), in step time."""
    idle_ready_s: float = 0.0
    """Idle-ready (``BACKFILL_SCHED_IDLE_READY_S``): while interactive work is in the engine
    and for this long after, batch sits steps out (but for sequences at their starvation
    bound), so interactive work runs alone and the next arrival of a burst finds the engine
    idle. 0: off. Needs ``idle_rule``."""
    idle_rule: IdleRule | None = None
    """The rule that decides it, the engine class's own (:data:`IdleRule`)."""

    def __post_init__(self) -> None:
        for name in ("lift_cap_after_s", "lifted_step_target_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be >= 0 seconds")
        if not (math.isfinite(self.idle_ready_s) and self.idle_ready_s >= 0):
            raise ValueError("idle_ready_s must be >= 0 seconds (0: off)")
        if self.idle_ready_s > 0 and self.idle_rule is None:
            raise ValueError(
                "idle_ready_s needs the engine class's rule: pass "
                "idle_rule=backfill_vllm.policy.idle_ready"
            )
        if not (math.isfinite(self.ride_along_share) and self.ride_along_share >= 0):
            raise ValueError("ride_along_share must be a number >= 0")
        if not (math.isfinite(self.chunk_target_s) and self.chunk_target_s > 0):
            raise ValueError("chunk_target_s must be a positive number of seconds")
        if self.starvation_steps < 0:
            raise ValueError("starvation_steps must be >= 0 (0: no bound in steps)")
        if not (math.isfinite(self.starvation_s) and self.starvation_s >= 0):
            raise ValueError("starvation_s must be >= 0 seconds (0: no bound in seconds)")
        if not (math.isfinite(self.interactive_likely_s) and self.interactive_likely_s >= 0):
            raise ValueError("interactive_likely_s must be >= 0 seconds (0: no whole-step bound)")


def sits_out(schedule: StepSchedule, interactive_quiet_s: float) -> bool:
    """Whether batch sits this step out, leaving the engine to interactive work and idle for
    its next arrival (the engine class's rule, :attr:`StepSchedule.idle_rule`);
    ``interactive_quiet_s`` is 0 while interactive work is in the engine."""
    rule = schedule.idle_rule
    if rule is None or schedule.idle_ready_s <= 0:
        return False
    return rule(schedule.idle_ready_s, interactive_quiet_s)


def starved(
    schedule: StepSchedule,
    progress_step: int,
    progress_s: float,
    step: int,
    now: float,
    step_s: float,
) -> bool:
    """Whether a paused batch sequence whose last progress was in step ``progress_step``,
    ending at ``progress_s``, must progress in step ``step``, which starts at ``now`` and is
    expected to take ``step_s``: waiting one more step would miss a bound."""
    n, t = schedule.starvation_steps, schedule.starvation_s
    return (n > 0 and step - progress_step >= n) or (t > 0 and now + 2 * step_s - progress_s > t)


def prefill_seconds(cost: CostModel, start: int, tokens: int) -> float:
    """The step time a prompt chunk of ``tokens`` from position ``start`` adds."""
    attention = tokens * start + tokens * (tokens + 1) / 2
    return cost.per_prefill_token_s * tokens + cost.per_prefill_attention_s * attention


def chunk_tokens(cost: CostModel, start: int, seconds: float, limit: int) -> int:
    """The most prompt tokens (up to ``limit``) from position ``start`` whose prefill adds at
    most ``seconds`` to a step."""
    if seconds <= 0 or limit <= 0:
        return 0
    if math.isinf(seconds):
        return limit
    b, d = cost.per_prefill_token_s, cost.per_prefill_attention_s
    if d > 0:
        # d/2 n^2 + (b + d*start + d/2) n <= seconds
        lin = b + d * start + d / 2
        n = int((-lin + math.sqrt(lin * lin + 2 * d * seconds)) / d)
    elif b > 0:
        n = int(seconds / b)
    else:
        return limit
    n = min(max(n, 0), limit)
    # Float rounding at the boundary: step back until it fits.
    while n > 0 and prefill_seconds(cost, start, n) > seconds * (1 + 1e-12):
        n -= 1
    return n


def decode_token_seconds(cost: CostModel, context: int) -> float:
    """The step time one more decoding sequence of ``context`` tokens adds."""
    return cost.per_decode_token_s + cost.per_decode_context_s * context
