"""What a simulated run measures, and the summary per policy."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of unsorted values; NaN for none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


@dataclass
class KvSample:
    """The pool at one instant, in blocks."""

    t: float
    interactive: int
    batch: int


@dataclass
class PolicyResult:
    """One policy's run."""

    policy: str
    duration_s: float
    interactive_requests: int
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    slo_attainment: float
    """Share of interactive requests whose first token came within the TTFT target
    (unserved ones count as missing it)."""
    batch_output_tokens: int
    batch_tokens_per_s: float
    batch_prompt_tokens_per_s: float
    """Batch prompt tokens computed per second (recomputation included)."""
    interactive_tokens_per_s: float
    """Interactive prompt and output tokens computed per second."""
    batch_items_completed: int
    deadline_attainment: float
    """Of the batch items whose deadline fell inside the run: the share finished by it."""
    items_expired: int
    kv_utilisation: float
    """Time-weighted mean share of the pool's blocks allocated."""
    preemptions: int
    recomputed_tokens: int
    max_blocks_in_use: int
    steps: int
    busy_s: float
    """Simulated time the engine spent in steps."""
    wall_s: float
    kv_timeline: list[KvSample] = field(default_factory=list, repr=False)
    ttfts: list[float] = field(default_factory=list, repr=False)

    def attainment(self, ttft_target_s: float) -> float:
        """SLO attainment at another TTFT target (from the recorded first-token times)."""
        if not self.ttfts:
            return 1.0
        return sum(1 for t in self.ttfts if t <= ttft_target_s) / len(self.ttfts)

    def row(self) -> dict[str, float | int | str]:
        """The table's columns (no per-request lists)."""
        return {
            "policy": self.policy,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p99_s": self.ttft_p99_s,
            "itl_p50_s": self.itl_p50_s,
            "itl_p99_s": self.itl_p99_s,
            "slo": self.slo_attainment,
            "batch_tok_s": self.batch_tokens_per_s,
            "deadline": self.deadline_attainment,
            "kv_util": self.kv_utilisation,
            "preempt": self.preemptions,
            "recomputed": self.recomputed_tokens,
        }

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            k: v for k, v in self.__dict__.items() if k not in {"kv_timeline", "ttfts"}
        }
        return {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in data.items()
        }
