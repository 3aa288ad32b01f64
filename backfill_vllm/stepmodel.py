"""The engine's step time as a line in the tokens a step carries, fitted from measured steps.

``step_s ~= a + b * tokens``: ``a`` is what a step costs whatever it carries (launch, sampling,
the scheduler itself), ``b`` what each token adds. Least squares over the most recent
``window`` steps (running sums, so each observation costs O(1) and memory stays bounded); the
fit follows the machine as its load changes, which on a shared CPU it does all the time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepFit:
    """A fitted step-time line."""

    base_s: float
    """``a``: seconds a step costs whatever it carries."""
    per_token_s: float
    """``b``: seconds each scheduled token adds (> 0)."""
    samples: int

    def seconds(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens

    def tokens_within(self, seconds: float) -> int:
        """The most tokens whose marginal cost stays within ``seconds``."""
        # The epsilon keeps 0.01 s / 0.0005 s from flooring to 19.
        return max(0, math.floor(seconds / self.per_token_s + 1e-9))


class StepTimeModel:
    """Online least squares of step time on tokens over a sliding window."""

    def __init__(self, window: int = 256, min_samples: int = 16) -> None:
        if window < 2 or not 2 <= min_samples <= window:
            raise ValueError("need window >= 2 and 2 <= min_samples <= window")
        self.window = window
        self.min_samples = min_samples
        self._samples: deque[tuple[float, float]] = deque()
        self._sx = self._sy = self._sxx = self._sxy = 0.0
        self._since_resum = 0

    def __len__(self) -> int:
        return len(self._samples)

    def observe(self, tokens: int, seconds: float) -> None:
        """One measured step; steps with no tokens or an impossible time are ignored."""
        if tokens <= 0 or not (math.isfinite(seconds) and seconds > 0):
            return
        x, y = float(tokens), float(seconds)
        self._samples.append((x, y))
        self._add(x, y, 1.0)
        if len(self._samples) > self.window:
            old_x, old_y = self._samples.popleft()
            self._add(old_x, old_y, -1.0)
        self._since_resum += 1
        if self._since_resum >= 4 * self.window:
            # Subtracting evicted samples drifts in floating point; start the sums over.
            self._sx = self._sy = self._sxx = self._sxy = 0.0
            for sx, sy in self._samples:
                self._add(sx, sy, 1.0)
            self._since_resum = 0

    def _add(self, x: float, y: float, sign: float) -> None:
        self._sx += sign * x
        self._sy += sign * y
        self._sxx += sign * x * x
        self._sxy += sign * x * y

    def fit(self) -> StepFit | None:
        """The fitted line, or None before ``min_samples`` steps. When the steps seen carry too
        few distinct token counts for a slope (or the noise gives a slope <= 0), the time is
        taken as proportional to tokens: a cap sized from it errs small, not large."""
        n = len(self._samples)
        if n < self.min_samples:
            return None
        mean_x, mean_y = self._sx / n, self._sy / n
        var_x = self._sxx / n - mean_x * mean_x
        cov = self._sxy / n - mean_x * mean_y
        if var_x > 1.0 and cov > 0:
            b = cov / var_x
            a = mean_y - b * mean_x
            if a < 0:
                # A negative fixed cost is noise; keep the line through the mean.
                a, b = 0.0, mean_y / mean_x
            return StepFit(a, b, n)
        return StepFit(0.0, mean_y / mean_x, n)
