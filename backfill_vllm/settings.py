"""The step scheduler's settings, from ``BACKFILL_SCHED_*`` environment variables.

vLLM builds the scheduler class itself (``--scheduler-cls``) and passes it no options of ours,
so the engine process's environment is where an operator sets them. A bad value stops the
engine at start with one line naming the variable, never a silent default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

PREFIX = "BACKFILL_SCHED_"
_FLAGS = {"1": True, "true": True, "yes": True, "on": True}
_FLAGS |= {"0": False, "false": False, "no": False, "off": False}


class SettingsError(ValueError):
    """A ``BACKFILL_SCHED_*`` variable holds a value the scheduler cannot use."""


@dataclass(frozen=True, slots=True)
class SchedulerSettings:
    """What the step scheduler does, per setting; the defaults match the simulator's
    ``backfill-step`` (``backfill_analysis.simulate.stepsched.StepSchedule``)."""

    batch_priority: int = 10
    """Requests at this vLLM priority or above are batch (Backfill's worker sends 10, its
    gateway 0)."""
    chunk_target_s: float = 0.01
    """Batch prefill one step may carry, in step time priced by the fitted step-time model:
    an interactive request arriving mid-step waits at most about this long for the step in
    flight."""
    lift_cap_after_s: float = 10.0
    """With no interactive request in the engine (waiting or running) for this long, batch
    prefill is not capped (vLLM's own token budget): batch alone runs as fast as on the stock
    engine, and the first interactive request after the quiet spell waits at most one such
    step before the cap is back. 0: always capped (the simulator's ``backfill-step``)."""
    lifted_step_target_s: float = 0.0
    """How far a lift goes, in seconds: batch prefill up to what the step-time model says fits
    in this long (never less than the capped chunk). 0: as ``lift_fixed_share`` says."""
    lift_fixed_share: float = 0.0
    """... or, with no target in seconds, as far as keeps a step's fixed cost (the fitted
    line's intercept) at this share of the step: batch alone loses about this share against
    vLLM's whole budget, and the first interactive request after a quiet spell waits at most
    ``1 / share`` fixed costs for the step in flight. A constant in seconds cannot be right on
    every engine: vLLM's 2,048-token step is ~1 s on one CPU, ~5 s on a CPU without bfloat16,
    ~0.1 s on a GPU. 0 (default): vLLM's whole token budget. Not the default: on the CPU
    without bfloat16, 0.05 did not shorten the 9 s a lone interactive request waited beside
    batch, and on a slow bfloat16 CPU it cost batch alone ~9% while interactive p50 beside
    batch was no better (bench/RESULTS.md, 2026-12-04)."""
    chunk_tokens: int = 256
    """The batch prefill cap per step until the model has ``model_min_samples`` steps."""
    min_chunk_tokens: int = 16
    """The cap never goes below this (a slope fitted on a noisy machine can be huge)."""
    max_chunk_tokens: int = 2048
    """... nor above this while capped (a slope fitted near zero would otherwise give batch
    vLLM's whole budget in a step interactive work may be waiting behind). The lift is not
    bounded by it."""
    interactive_likely_s: float = 2.0
    """For this long after an interactive request was last in the engine, more are likely
    (arrivals come in bursts), and every step is bounded whole: batch decodes and prefill
    together add at most ``chunk_target_s`` to it by the fitted model (half that for a step
    scheduled ahead under async scheduling, where an arrival also waits for the step in
    flight), batch decodes running in turns when they alone would pass it. 0: only batch
    prefill is capped."""
    ahead_while_likely: bool = False
    """Under async scheduling (vLLM schedules a step while the one before it runs), whether
    a step that would carry batch alone is still scheduled ahead while interactive work is
    likely (``interactive_likely_s``) but none is in the engine. Off (default): such a step
    waits for the one in flight (the scheduler hands vLLM an empty step, and vLLM's engine
    loop then waits for the step in flight before it schedules again), so an interactive
    request arriving mid-step waits for that step alone, not for the one queued behind it
    too; batch pays the host's share of those steps (scheduling and input preparation, which
    async scheduling hides). On: every step is scheduled ahead, as vLLM does."""
    idle_ready_s: float = 0.0
    """Idle-ready: while an interactive request is in the engine and for this long after,
    batch sits out every step: its sequences stay resident and carry nothing, none is
    admitted (the starvation bound still holds), so interactive work runs alone and the next
    arrival of a burst finds the engine idle instead of behind a step in flight (the fixed
    cost of a step and the batch decodes in it). Batch loses those windows; set
    ``lift_cap_after_s`` to the same, so it makes up for them in long steps between bursts.
    0 (default): off."""
    ride_along_share: float = 0.0
    """While interactive work waits or prefills, batch decode tokens may ride along up to this
    share of the step's own time (0: every batch sequence pauses)."""
    starvation_steps: int = 0
    """A paused batch sequence carries tokens at least once every this many steps (0: no
    bound in steps)."""
    starvation_s: float = 1.0
    """... and within this many seconds of its last progress (0: no bound in seconds)."""
    model_window: int = 256
    """Step-time samples the model keeps (the most recent)."""
    model_min_samples: int = 16
    """Samples before the fitted model sizes the chunk cap."""
    metrics_port: int = 0
    """Port of the scheduler's Prometheus text (``/metrics``); 0: not served."""
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SettingsError(
                    f"{PREFIX}{name.upper()}={getattr(self, name)!r}: must be {what}"
                )

        for name in (
            "chunk_target_s",
            "ride_along_share",
            "starvation_s",
            "lift_cap_after_s",
            "lifted_step_target_s",
            "lift_fixed_share",
            "interactive_likely_s",
            "idle_ready_s",
        ):
            value = getattr(self, name)
            need(math.isfinite(value) and value >= 0, name, "a number >= 0")
        need(self.chunk_target_s > 0, "chunk_target_s", "> 0 seconds")
        need(self.ride_along_share <= 1, "ride_along_share", "between 0 and 1")
        need(self.lift_fixed_share < 1, "lift_fixed_share", "below 1 (0: vLLM's whole budget)")
        need(self.chunk_tokens >= 1, "chunk_tokens", "at least 1")
        need(self.min_chunk_tokens >= 1, "min_chunk_tokens", "at least 1")
        need(
            self.max_chunk_tokens >= self.min_chunk_tokens,
            "max_chunk_tokens",
            f"at least the least chunk ({self.min_chunk_tokens})",
        )
        need(self.starvation_steps >= 0, "starvation_steps", ">= 0 (0: no bound in steps)")
        need(self.model_window >= 2, "model_window", "at least 2")
        need(
            2 <= self.model_min_samples <= self.model_window,
            "model_min_samples",
            f"between 2 and the model window ({self.model_window})",
        )
        need(0 <= self.metrics_port <= 65535, "metrics_port", "a port (0: not served)")
        need(bool(self.metrics_host), "metrics_host", "a host name or address")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> SchedulerSettings:
        """The settings the ``BACKFILL_SCHED_*`` variables in ``environ`` (default: this
        process's) give; unset or empty variables keep their defaults."""
        env = os.environ if environ is None else environ
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(
            k for k in env if k.startswith(PREFIX) and k[len(PREFIX) :].lower() not in known
        )
        if unknown:
            raise SettingsError(
                f"unknown setting {unknown[0]} (known: "
                f"{', '.join(PREFIX + n.upper() for n in known)})"
            )
        defaults = cls()
        values: dict[str, object] = {}
        for name in known:
            raw = env.get(PREFIX + name.upper(), "").strip()
            if not raw:
                continue
            kind = type(getattr(defaults, name))
            if kind is bool:
                flag = _FLAGS.get(raw.lower())
                if flag is None:
                    raise SettingsError(f"{PREFIX}{name.upper()}={raw!r}: must be 1 or 0")
                values[name] = flag
                continue
            try:
                values[name] = kind(raw)
            except ValueError:
                what = {int: "an integer", float: "a number"}.get(kind, "text")
                raise SettingsError(f"{PREFIX}{name.upper()}={raw!r}: must be {what}") from None
        return cls(**values)  # type: ignore[arg-type]
