"""What one protection scenario measured (:class:`ScenarioResult`, its summary as the JSON
record holds it), the run's settings (:class:`Config`) and the Backfill settings variants
``a`` runs under (:class:`Variant`, ``--variant NAME:KEY=VALUE,...``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from backfill_analysis.simulate.trace import TraceOptions
from bench.common import percentile
from bench.protection import plan
from bench.protection.replay import InteractiveResult
from bench.protection.split import ttft_split


@dataclass(frozen=True)
class Config:
    model: str
    trace: TraceOptions
    trace_path: Path
    warmup_s: float
    concurrency: int
    batch_priority: int
    batch_prompt_chars: int
    batch_max_tokens: int
    kv_cache_gib: int
    duration_s: float = 90.0
    """Seconds of (stretched) trace per scenario."""
    time_scale: float | None = None
    """A fixed stretch; None sizes it from the probed engine."""
    target_busy: float = plan.TARGET_BUSY
    scheduler_cls: str | None = None
    """vLLM ``--scheduler-cls`` for the engine the Backfill scenarios run on."""
    batch_window_s: float = 90.0
    """Batch alone is measured at least this long."""
    drain_timeout_s: float = 180.0


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, str]


@dataclass
class ScenarioResult:
    name: str
    policy: str
    """The engine's scheduling policy."""
    interactive: list[InteractiveResult] | None
    batch: str | None
    """How batch work reached the engine: ``straight``, ``backfill`` or None."""
    window_s: float
    engine: dict[str, float]
    """Engine counter deltas over the window."""
    load: dict[str, float] = field(default_factory=dict)
    backfill: dict[str, float] = field(default_factory=dict)
    overrides: dict[str, str] = field(default_factory=dict)
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)
    cpu: dict[str, float] = field(default_factory=dict)
    """Cores each role used over the window (:mod:`bench.protection.cpu_share`)."""
    scheduler: dict[str, float] = field(default_factory=dict)
    """The step scheduler's counter deltas over the window (empty on a stock engine)."""

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.interactive or () if r.ok and r.ttft is not None]

    @property
    def itls(self) -> list[float]:
        return [x for r in self.interactive or () if r.ok for x in r.itls]

    @property
    def rejected(self) -> int:
        """Refused with an HTTP status (the gateway's 429/413/503, or the engine's 4xx)."""
        return sum(1 for r in self.interactive or () if r.status not in (0, 200))

    @property
    def failed(self) -> int:
        """Accepted but broken: an error event, no text, or the connection lost."""
        return sum(1 for r in self.interactive or () if r.status in (0, 200) and not r.ok)

    @property
    def interactive_output_tokens(self) -> int:
        return sum(r.output_tokens or len(r.chunk_times) for r in self.interactive or ())

    @property
    def interactive_prompt_tokens(self) -> int:
        """Prompt tokens of the interactive requests the engine accepted."""
        return sum(r.prompt_tokens for r in self.interactive or () if r.status == 200)

    @property
    def batch_tokens_processed(self) -> float:
        """Batch prompt and output tokens the engine processed in the window."""
        counted = self.engine["vllm:prompt_tokens_total"]
        counted += self.engine["vllm:generation_tokens_total"]
        return counted - self.interactive_prompt_tokens - self.interactive_output_tokens

    @property
    def interactive_busy(self) -> float | None:
        """The share of the window with an interactive request in the engine (sent to last
        token)."""
        replayed = [r for r in self.interactive or () if r.status == 200 and r.chunk_times]
        if not self.interactive:
            return None
        start = min(r.sent for r in self.interactive)
        spans = [(r.sent, r.chunk_times[-1]) for r in replayed]
        return plan.busy_share(spans, start, start + self.window_s)

    @property
    def batch_output_tokens(self) -> float:
        return self.engine["vllm:generation_tokens_total"] - self.interactive_output_tokens

    @property
    def batch_tps(self) -> float | None:
        if self.batch is None:
            return None
        return self.batch_output_tokens / self.window_s if self.window_s > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        ttfts, itls = self.ttfts, self.itls
        replayed = self.interactive or []
        origin = replayed[0].scheduled if replayed else 0.0
        return {
            "scenario": self.name,
            "policy": self.policy,
            "batch": self.batch,
            "overrides": self.overrides,
            "window_s": self.window_s,
            "interactive_requests": len(self.interactive or ()),
            "interactive_ok": len(ttfts),
            "interactive_rejected": self.rejected,
            "interactive_failed": self.failed,
            "ttft_p50_s": percentile(ttfts, 50) if ttfts else None,
            "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
            "ttft_p99_s": percentile(ttfts, 99) if ttfts else None,
            "itl_p50_s": percentile(itls, 50) if itls else None,
            "itl_p99_s": percentile(itls, 99) if itls else None,
            "interactive_busy": self.interactive_busy,
            "batch_output_tokens_per_s": self.batch_tps,
            "batch_tokens_processed": self.batch_tokens_processed if self.batch else None,
            "batch_tokens_processed_per_s": (
                self.batch_tokens_processed / self.window_s
                if self.batch and self.window_s > 0
                else None
            ),
            "engine_preemptions": self.engine["vllm:num_preemptions_total"],
            "engine_prefix_cache_hits": self.engine["vllm:prefix_cache_hits_total"],
            "engine_prompt_tokens": self.engine["vllm:prompt_tokens_total"],
            "engine_generation_tokens": self.engine["vllm:generation_tokens_total"],
            "engine_load": self.load,
            "backfill": self.backfill,
            "loadavg_1m_5m_15m": self.loadavg,
            "cpu_cores": self.cpu,
            "scheduler": self.scheduler,
            "ttft_split": ttft_split(
                self.engine,
                self.scheduler,
                self.batch is None and self.interactive is not None,
                ttfts,
            ),
            "requests": [
                {
                    "index": r.index,
                    "arrival_s": round(r.scheduled - origin, 3),
                    "prompt_tokens": r.prompt_tokens,
                    "max_tokens": r.max_tokens,
                    "status": r.status,
                    "ttft_s": r.ttft,
                    "send_lag_s": round(r.sent - r.scheduled, 4),
                    "output_tokens": r.output_tokens,
                    "error": r.error,
                }
                for r in replayed
            ],
        }


def parse_variant(text: str) -> Variant:
    """``NAME:KEY=VALUE,KEY=VALUE`` (``NAME`` alone: no overrides)."""
    name, _, rest = text.partition(":")
    overrides: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key:
            raise SystemExit(f"--variant {text!r}: expected NAME:KEY=VALUE,...")
        overrides[key.strip()] = value.strip()
    if not name:
        raise SystemExit(f"--variant {text!r}: needs a name")
    return Variant(name, overrides)


def say(message: str) -> None:
    print(f"[protection] {message}", file=sys.stderr, flush=True)
