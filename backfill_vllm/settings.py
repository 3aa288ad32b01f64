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
    ``backfill-step`` (``backfill_analysis.simulate.stepsched.StepSchedule``). The docstring
    under each field is its meaning on docs/configuration.md (``python -m devkit.config_doc``
    reads them from this source: nothing here imports vLLM)."""

    batch_priority: int = 10
    """requests at this priority or above are batch (the worker's `BACKFILL_BATCH_PRIORITY`:
    Backfill's worker sends 10, its gateway 0)"""
    chunk_target_s: float = 0.01
    """batch prefill a step may carry, in step time priced by the fitted model (how long an
    interactive arrival may wait for the step in flight; the simulator's CPU scenario uses
    0.1). On step times measured on an H200 (`bench.gpu_steps`), 0.004 keeps interactive TTFT
    p50 and p99 within 1.1x of alone with half of batch alone's throughput; 0.01 keeps 0.75 of
    it at p50 1.19x"""
    lift_cap_after_s: float = 10.0
    """with no interactive request in the engine (waiting or running) for this long, batch
    prefill is lifted to vLLM's own token budget (or as the next two rows bound it; batch alone
    then runs about as on the stock engine, and the first interactive request after the quiet
    spell waits at most one such step); `0`: always capped (the simulator's `backfill-step`)"""
    lifted_step_target_s: float = 0.0
    """how far a lift goes, in seconds: batch prefill up to what the step-time model says fits
    in this long (never less than the capped chunk), in place of the share (`0`:
    `LIFT_FIXED_SHARE` decides)"""
    lift_fixed_share: float = 0.0
    """... or, with no target in seconds: batch prefill until a step's fixed cost (the fitted
    model's intercept: what a step costs besides its prompt tokens and its decoding sequences)
    is this share of the step, at most vLLM's whole token budget. Batch alone then loses about
    this share against the whole budget, and the first interactive request after a quiet spell
    waits for one step of at most `1 / share` fixed costs: vLLM's 2,048-token step is ~1 s on a
    CPU with bfloat16 (barely bounded) and ~5 s on one without (bounded to ~1.4 s at 0.05);
    `0`: vLLM's whole budget (default: on that CPU 0.05 did not shorten the wait of a lone
    interactive request beside batch, and on a slow CPU with bfloat16 it cost batch alone ~9%
    with interactive p50 beside batch no better, bench/RESULTS.md)"""
    chunk_tokens: int = 256
    """the cap until the model has `MODEL_MIN_SAMPLES` steps"""
    min_chunk_tokens: int = 16
    """the cap never goes below this (a slope fitted on a noisy machine can be huge)"""
    max_chunk_tokens: int = 2048
    """... nor above this while capped (a near-flat fitted slope would otherwise hand batch
    vLLM's whole budget in a step interactive work may be waiting behind); the lift is not
    bounded by it. The step-time model also keeps a step 4x slower than it predicts out of its
    fit (`backfill_sched_step_outliers_total`), unless 8 come in a row (the machine changed)"""
    interactive_likely_s: float = 2.0
    """the whole-step bound: while interactive work is in the engine and for this long after
    (arrivals come in bursts), batch decodes and prefill together add at most `CHUNK_TARGET_S`
    to a step by the fitted model, half that for a step scheduled ahead under async scheduling
    (an arrival waits for the step in flight and the one already scheduled behind it); batch
    decodes take turns when they alone would pass it (`backfill_sched_bounded_steps_total`);
    `0`: only batch prefill is capped"""
    ahead_while_likely: bool = False
    """under async scheduling (vLLM's default on GPU, where it schedules each step while the
    one before it runs), within that window and with no interactive request in the engine, a
    step that would carry batch alone is held back (off, the default): the scheduler hands
    vLLM an empty step, its engine loop waits for the step in flight, and an interactive
    request arriving meanwhile is in the very next step instead of behind one more batch step
    (`backfill_sched_held_back_steps_total`). Batch pays the host's share of those steps (the
    scheduling and input preparation async scheduling hides) and gets the whole step target in
    them (a step scheduled ahead gets half); `1`: every step is scheduled ahead, as vLLM
    does"""
    idle_ready_s: float = 0.0
    """idle-ready: while an interactive request is in the engine and for this long after,
    batch sits out every step (resident, carrying nothing, none admitted; `STARVATION_S` still
    holds): interactive work runs alone, and the next arrival of a burst finds the engine idle
    instead of behind a step in flight, whose fixed cost no cap on batch tokens shortens. Set
    `LIFT_CAP_AFTER_S` to the same and a `LIFTED_STEP_TARGET_S`, so batch makes up in long
    steps between bursts what it gives up in them; under async scheduling those steps are held
    back too while `INTERACTIVE_LIKELY_S` lasts (a lifted step within that window is not
    scheduled ahead). Pair it with a looser `STARVATION_S`: at 1 s the bound relieves every
    paused batch sequence in the middle of a long burst. On the measured H200 steps
    (`bench.gpu_steps`), 2 s with a 2 s lift to 0.05 s, `STARVATION_S=10` and
    `INTERACTIVE_LIKELY_S=10` keeps 0.61 of batch with TTFT p50 1.047x and p99 1.00x of alone
    (the whole-step bound alone: 1.08x at 0.26; bench/RESULTS.md, "Idle-ready"); not yet
    measured on the CPU engine; `0`: off"""
    ride_along_share: float = 0.0
    """while interactive work is pending (waiting or prefilling), batch decode tokens may still
    ride along up to this share of the step's time (`0`: all batch pauses)"""
    starvation_steps: int = 0
    """a paused batch sequence carries tokens at least once every this many steps (`0`: no
    bound in steps)"""
    starvation_s: float = 1.0
    """... and within this many seconds of its last progress (`0`: no bound in seconds)"""
    model_window: int = 256
    """the step-time model's memory (most recent steps). The model is `step = fixed + per
    prompt token x prompt tokens + per decode x decoding sequences`, least squares over that
    window; a window whose steps all carry about the same prompt tokens (every step of a lift)
    keeps the last fit made while they spread"""
    model_min_samples: int = 16
    """the steps the model needs before it sizes the cap"""
    metrics_port: int = 0
    """where the counters are served as Prometheus text (`/metrics`), with `METRICS_HOST`; `0`:
    not served"""
    metrics_host: str = "127.0.0.1"
    """the address the counters are served on"""

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
