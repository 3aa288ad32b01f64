"""A closed-loop client against the simulated engine: ``concurrency`` requests in flight,
each next one sent when one finishes. The calibration check replays the same workload here
and against the real engine."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from backfill_analysis.simulate.engine import Engine, EngineConfig
from backfill_analysis.simulate.engine import Sequence as EngineSequence
from backfill_analysis.simulate.metrics import percentile


@dataclass(frozen=True)
class ClosedLoopResult:
    makespan_s: float
    output_tokens: int
    ttfts: tuple[float, ...]

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def ttft_p50_s(self) -> float:
        return percentile(self.ttfts, 50)


def closed_loop(
    config: EngineConfig, shapes: Sequence[tuple[int, int]], concurrency: int
) -> ClosedLoopResult:
    """Send ``shapes`` (prompt, output) in order, ``concurrency`` at a time."""
    engine = Engine(config)
    overhead = config.cost.request_overhead_s
    pending = list(reversed(list(enumerate(shapes))))
    sent_at: dict[int, float] = {}
    ready: list[tuple[float, EngineSequence]] = []
    ttfts: list[float] = []
    now = 0.0
    in_flight = 0

    def send(at: float) -> None:
        nonlocal in_flight
        key, (prompt, output) = pending.pop()
        seq = EngineSequence(key, prompt, output, 0, True)
        sent_at[key] = at
        ready.append((at + overhead, seq))
        in_flight += 1

    while pending and in_flight < concurrency:
        send(0.0)
    while in_flight:
        for item in [r for r in ready if r[0] <= now]:
            ready.remove(item)
            engine.add(item[1])
        report = engine.step(now)
        if report.seconds <= 0:
            now = min(r[0] for r in ready)
            continue
        now += report.seconds
        for seq in report.first_tokens:
            ttfts.append(seq.first_token_s - sent_at[seq.key])
        for _ in report.finished:
            in_flight -= 1
            if pending:
                send(now)
    total = sum(out for _, out in shapes)
    return ClosedLoopResult(now, total, tuple(ttfts))
