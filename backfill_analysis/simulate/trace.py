"""Interactive request traces: any CSV with the Azure LLM inference trace's columns.

``TIMESTAMP,ContextTokens,GeneratedTokens`` - one request a line; timestamps are absolute
(``2023-11-16 18:17:03.9799600``) or seconds. Arrivals are made relative to the first one,
may be stretched or compressed (``time_scale``), and sizes clipped to what an engine serves.
"""

from __future__ import annotations

import csv
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from backfill.errors import BackfillError

COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")

AZURE_CODE_TRACE = Path(__file__).resolve().parent.parent / "traces" / "azure_llm_2023_code.csv"
"""The bundled trace: one hour of an Azure coding assistant's arrivals (``traces/README.md``),
the default interactive load of the simulator and the benchmarks."""


class TraceError(BackfillError):
    """A trace file that cannot be read as a request trace."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float
    """Seconds after the trace's first request (after scaling)."""
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class TraceOptions:
    """How a trace is replayed."""

    time_scale: float = 1.0
    """Multiplies every gap between arrivals: 2.0 stretches the trace to half the rate."""
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    duration_s: float | None = None
    """Keep requests arriving before this (after scaling)."""
    skip: int = 0
    """Rows to drop from the start."""
    rows: int | None = None
    """Rows to keep after those skipped (None: all)."""
    every: int = 1
    """Keep every n-th request: one node's share of a cluster's trace behind a round-robin
    balancer (the Azure trace is a whole service's traffic, not one engine's)."""

    def __post_init__(self) -> None:
        if not self.time_scale > 0 or not math.isfinite(self.time_scale):
            raise TraceError(f"time_scale must be positive, got {self.time_scale}")
        if self.skip < 0 or self.every < 1:
            raise TraceError("skip must be >= 0 and every >= 1")
        if self.rows is not None and self.rows < 1:
            raise TraceError(f"rows must be >= 1, got {self.rows}")


def _seconds(raw: str) -> float:
    text = raw.strip()
    try:
        return float(text)
    except ValueError:
        pass
    # Python's fromisoformat takes at most 6 fraction digits; the Azure trace has 7.
    head, dot, frac = text.partition(".")
    try:
        moment = datetime.fromisoformat(head)
    except ValueError:
        raise TraceError(f"TIMESTAMP {raw!r} is neither seconds nor a date-time") from None
    return moment.timestamp() + (float(f"0.{frac}") if dot and frac.isdigit() else 0.0)


def parse_rows(rows: Iterable[dict[str, str]], options: TraceOptions) -> list[TraceRequest]:
    """Requests from CSV rows (dicts keyed by the trace's columns), sorted by arrival."""
    raw: list[tuple[float, int, int]] = []
    for i, row in enumerate(rows):
        if i < options.skip:
            continue
        if options.rows is not None and i >= options.skip + options.rows:
            break
        try:
            t = _seconds(row["TIMESTAMP"])
            prompt = int(row["ContextTokens"])
            output = int(row["GeneratedTokens"])
        except KeyError as exc:
            raise TraceError(f"trace lacks column {exc}; need {', '.join(COLUMNS)}") from None
        except (TypeError, ValueError):
            raise TraceError(f"row {i + 1}: sizes must be integers: {row}") from None
        if prompt < 0 or output < 0:
            raise TraceError(f"row {i + 1}: negative size: {row}")
        raw.append((t, max(1, prompt), max(1, output)))
    raw.sort(key=lambda r: r[0])
    if not raw:
        return []
    t0 = raw[0][0]
    out: list[TraceRequest] = []
    max_prompt = options.max_prompt_tokens or math.inf
    max_output = options.max_output_tokens or math.inf
    for t, prompt, output in raw[:: options.every]:
        arrival = (t - t0) * options.time_scale
        if options.duration_s is not None and arrival >= options.duration_s:
            break
        prompt_kept, output_kept = int(min(prompt, max_prompt)), int(min(output, max_output))
        out.append(TraceRequest(arrival, prompt_kept, output_kept))
    return out


def load_trace(path: Path | str, options: TraceOptions | None = None) -> list[TraceRequest]:
    """Read a trace CSV (see the module's doc for the schema)."""
    try:
        with Path(path).open(newline="") as handle:
            return parse_rows(csv.DictReader(handle), options or TraceOptions())
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None


def concurrent_tokens(
    requests: Sequence[TraceRequest], decode_tokens_per_s: float, prefill_tokens_per_s: float
) -> list[tuple[float, int]]:
    """KV tokens interactive requests hold over time, assuming each is served at once at the
    given per-request rates: ``(time, tokens held from then on)`` at every change.

    A request holds its prompt from arrival and ends after ``prompt / prefill rate +
    output / decode rate``; planning charges its full ``prompt + output`` throughout (a
    reservation is the worst case, not the average).
    """
    if decode_tokens_per_s <= 0 or prefill_tokens_per_s <= 0:
        raise TraceError("rates must be positive")
    events: list[tuple[float, int]] = []
    for r in requests:
        size = r.prompt_tokens + r.output_tokens
        end = r.arrival_s + r.prompt_tokens / prefill_tokens_per_s
        end += r.output_tokens / decode_tokens_per_s
        events.append((r.arrival_s, size))
        events.append((end, -size))
    events.sort()
    level = 0
    out: list[tuple[float, int]] = []
    for t, delta in events:
        level += delta
        out.append((t, level))
    return out


def time_weighted_quantile(levels: Sequence[tuple[float, int]], q: float) -> int:
    """The level the series stays at or under for a fraction ``q`` of its span."""
    if not levels:
        return 0
    spans: list[tuple[int, float]] = []
    for (t, level), (t_next, _) in itertools.pairwise(levels):
        if t_next > t:
            spans.append((level, t_next - t))
    total = sum(d for _, d in spans)
    if total <= 0:
        return max(level for _, level in levels)
    acc = 0.0
    ordered = sorted(spans)
    for level, d in ordered:
        acc += d
        if acc >= q * total:
            return level
    return ordered[-1][0]
