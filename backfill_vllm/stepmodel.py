"""The engine's step time as a plane in the prefill and decode tokens a step carries, fitted
from measured steps.

``step_s ~= a + bp * prefill + bd * decodes``: ``a`` is what a step costs whatever it carries
(launch, sampling, the scheduler itself), ``bp`` what each prompt token adds, ``bd`` what each
decoding sequence adds (its one token, and its attention over everything it has computed).
Least squares over the most recent ``window`` steps (running sums, so each observation costs
O(1) and memory stays bounded); the fit follows the machine as its load changes, which on a
shared CPU it does all the time, as long as the steps carry a spread of prompt tokens (a window
of steps all at the cap keeps the last fit that could see the line).

A step far slower than the fitted plane predicts (``OUTLIER_FACTOR`` times: a pause of the
whole process, a page-fault storm, a neighbour on the core) is not let into the fit, where one
such step would raise the slope and shrink the cap for a whole window; after a run of
``MAX_OUTLIER_RUN`` such steps in a row the machine has changed, not stalled, and its steps
are let in until they fit again.

Two regressors, not one line in all tokens: a line's intercept takes in the decoding
sequences a busy engine carries in every step (measured on the CPU engine: 0.036 s with a few
sequences, 0.125 s with ~50, the same engine), so it is not the step's fixed cost, and a
share of the step kept for that cost (``lift_fixed_share``) stopped bounding anything. When
the steps seen do not tell the two apart (no spread in one of them, or the two moving
together), the fit falls back to the line in all tokens, then to time proportional to tokens.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# A fit of two regressors needs their correlation below this (|r| < ~0.995): closer, and the
# split between them is noise.
_COLLINEAR = 0.99
# A step this many times slower than the fit predicts is an outlier.
OUTLIER_FACTOR = 4.0
# ... unless this many come in a row: then the machine changed, and the fit must follow.
MAX_OUTLIER_RUN = 8


@dataclass(frozen=True, slots=True)
class StepFit:
    """A fitted step-time model."""

    base_s: float
    """``a``: seconds a step costs whatever it carries."""
    per_token_s: float
    """``bp``: seconds each prompt (prefill) token adds (> 0)."""
    samples: int
    per_decode_s: float | None = None
    """``bd``: seconds each decoding sequence adds; None: as a prompt token (no separate fit)."""

    @property
    def decode_s(self) -> float:
        return self.per_token_s if self.per_decode_s is None else self.per_decode_s

    def seconds(self, tokens: int, decodes: int = 0) -> float:
        return self.base_s + self.per_token_s * tokens + self.decode_s * decodes

    def tokens_within(self, seconds: float) -> int:
        """The most prompt tokens whose marginal cost stays within ``seconds``."""
        # The epsilon keeps 0.01 s / 0.0005 s from flooring to 19.
        return max(0, math.floor(seconds / self.per_token_s + 1e-9))

    def decodes_within(self, seconds: float) -> int:
        """The most decoding sequences whose marginal cost stays within ``seconds``."""
        return max(0, math.floor(seconds / self.decode_s + 1e-9))


class StepTimeModel:
    """Online least squares of step time on prefill tokens and decodes, over a sliding
    window."""

    def __init__(self, window: int = 256, min_samples: int = 16) -> None:
        if window < 2 or not 2 <= min_samples <= window:
            raise ValueError("need window >= 2 and 2 <= min_samples <= window")
        self.window = window
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float, float]] = deque()
        # Sums of p, d, y, pp, dd, pd, py, dy.
        self._s = [0.0] * 8
        self._since_resum = 0
        self._held: StepFit | None = None
        self._outlier_run = 0
        self.outliers = 0
        """Steps kept out of the fit as outliers."""

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, tokens: int, seconds: float, decodes: int = 0) -> None:
        """One measured step: ``tokens`` scheduled in all, ``decodes`` of them one-token
        decodes (the rest prompt tokens); steps with no tokens or an impossible time are
        ignored."""
        if tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        d = float(min(max(decodes, 0), tokens))
        sample = (float(tokens) - d, d, float(seconds))
        if self._outlier(sample):
            return
        self._samples.append(sample)
        self._add(sample, 1.0)
        if len(self._samples) > self.window:
            self._add(self._samples.popleft(), -1.0)
        self._since_resum += 1
        if self._since_resum >= 4 * self.window:
            # Subtracting evicted samples drifts in floating point; start the sums over.
            self._s = [0.0] * 8
            for kept in self._samples:
                self._add(kept, 1.0)
            self._since_resum = 0

    def _outlier(self, sample: tuple[float, float, float]) -> bool:
        """Whether to keep ``sample`` out of the fit (and count it)."""
        n = len(self._samples)
        if n < self.min_samples:
            return False
        fit, informative = self._solve(n)
        if not informative and self._held is not None:
            fit = self._held
        p, d, y = sample
        predicted = fit.base_s + fit.per_token_s * p + fit.decode_s * d
        off = predicted > 0 and y > predicted * OUTLIER_FACTOR
        if not off:
            self._outlier_run = 0
            return False
        if self._outlier_run >= MAX_OUTLIER_RUN:
            return False  # the machine changed: let its steps in until they fit again
        self._outlier_run += 1
        self.outliers += 1
        return True

    def _add(self, sample: tuple[float, float, float], sign: float) -> None:
        p, d, y = sample
        s = self._s
        for i, v in enumerate((p, d, y, p * p, d * d, p * d, p * y, d * y)):
            s[i] += sign * v

    def fit(self) -> StepFit | None:
        """The fitted model, or None before ``min_samples`` steps.

        A window whose steps all carry about the same prompt tokens says nothing of the fixed
        cost or the price of a token: that is every step once the chunk cap is lifted (each
        carries vLLM's whole budget, or the lift's bound). Such a window keeps the last fit
        made from steps that did spread, so the cap sized from it does not drift on a fit of
        noise. With no such fit yet, and too few distinct token counts for a slope (or noise
        giving a slope <= 0), time is taken as proportional to tokens: a cap sized from it errs
        small, not large."""
        n = len(self._samples)
        if n < self.min_samples:
            return None
        fit, informative = self._solve(n)
        if informative:
            self._held = fit
            return fit
        return self._held if self._held is not None else fit

    def _solve(self, n: int) -> tuple[StepFit, bool]:
        sp, sd, sy, spp, sdd, spd, spy, sdy = (v / n for v in self._s)
        vp, vd = spp - sp * sp, sdd - sd * sd
        cpd, cpy, cdy = spd - sp * sd, spy - sp * sy, sdy - sd * sy
        det = vp * vd - cpd * cpd
        if vp > 1.0 and vd > 1.0 and cpd * cpd < _COLLINEAR * vp * vd:
            bp = (vd * cpy - cpd * cdy) / det
            bd = (vp * cdy - cpd * cpy) / det
            a = sy - bp * sp - bd * sd
            if bp > 0 and bd > 0 and a >= 0:
                return StepFit(a, bp, n, bd), _spread(vp, sp)
        # The line in all tokens.
        sx, sxx, sxy = sp + sd, spp + sdd + 2 * spd, spy + sdy
        var_x = sxx - sx * sx
        cov = sxy - sx * sy
        if var_x > 1.0 and cov > 0:
            b = cov / var_x
            a = sy - b * sx
            if a < 0:
                # A negative fixed cost is noise; keep the line through the mean.
                a, b = 0.0, sy / sx
            return StepFit(a, b, n), _spread(var_x, sx)
        return StepFit(0.0, sy / sx, n), False


def _spread(variance: float, mean: float) -> bool:
    """Whether token counts of this variance about this mean can place a line: a standard
    deviation of at least 8 tokens and a tenth of the mean."""
    return variance > 0 and math.sqrt(variance) >= max(8.0, 0.1 * mean)


class StepsInFlight:
    """The steps scheduled and not yet come back, and how long each one that came back ran:
    what the step scheduler feeds :class:`StepTimeModel` with, and whether a step is in flight
    (under async scheduling vLLM schedules a step while the one before it runs)."""

    MAX_IN_FLIGHT = 16
    """More steps out than this and some never came back (an engine reset): forget them."""

    def __init__(self) -> None:
        self._in_flight: dict[int, tuple[int, float, int, int]] = {}
        """By the step's key (its output's id): (order, when scheduled, tokens, decodes)."""
        self._scheduled = 0
        self._last_back_s = 0.0
        self.last_step_s = 0.0
        """How long the last step that came back ran."""

    def __bool__(self) -> bool:
        return bool(self._in_flight)

    def sent(self, key: int, now: float, tokens: int, decodes: int) -> None:
        """A step of ``tokens`` tokens (``decodes`` of them single-token decodes) scheduled."""
        if len(self._in_flight) > self.MAX_IN_FLIGHT:
            self._in_flight.clear()  # outputs that never came back (engine reset)
        self._scheduled += 1
        self._in_flight[key] = (self._scheduled, now, tokens, decodes)

    def came_back(self, key: int, now: float) -> tuple[int, float, int] | None:
        """The step ``key`` came back at ``now``: its tokens, the seconds it ran and its
        decodes (None for a step not sent, or forgotten)."""
        sent = self._in_flight.pop(key, None)
        measured = None
        if sent is not None:
            order, scheduled_s, tokens, decodes = sent
            # Steps come back in the order they were scheduled: one scheduled before this
            # one and still here never will.
            for other in [k for k, v in self._in_flight.items() if v[0] < order]:
                del self._in_flight[other]
            # The step ran from when it was scheduled, or from when the one before it came
            # back if it was queued behind that one (async scheduling).
            seconds = now - max(scheduled_s, self._last_back_s)
            self.last_step_s = seconds
            measured = (tokens, seconds, decodes)
        self._last_back_s = now
        return measured
