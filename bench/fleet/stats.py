"""What ``bench.fleet`` measures: call latencies as mergeable histograms, CPU read from /proc.

A fleet run makes millions of calls; each is kept as one count in a log-spaced bucket (2% wide),
so processes can send theirs back cheaply and percentiles stay within a bucket of the truth.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

_GROWTH = 1.02
_FLOOR_S = 1e-6
_LOG_GROWTH = math.log(_GROWTH)


def _bucket(seconds: float) -> int:
    if seconds <= _FLOOR_S:
        return 0
    return 1 + int(math.log(seconds / _FLOOR_S) / _LOG_GROWTH)


def _upper_s(bucket: int) -> float:
    return float(_FLOOR_S * _GROWTH**bucket)


@dataclass
class Histogram:
    """Latencies of one kind of call."""

    counts: dict[int, int] = field(default_factory=dict)
    total: int = 0
    sum_s: float = 0.0

    def add(self, seconds: float) -> None:
        b = _bucket(seconds)
        self.counts[b] = self.counts.get(b, 0) + 1
        self.total += 1
        self.sum_s += seconds

    def merge(self, other: Histogram) -> None:
        for b, n in other.counts.items():
            self.counts[b] = self.counts.get(b, 0) + n
        self.total += other.total
        self.sum_s += other.sum_s

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100), as its bucket's upper edge (at most 2% high)."""
        if not self.total:
            return float("nan")
        rank = max(1, math.ceil(self.total * q / 100))
        seen = 0
        for b in sorted(self.counts):
            seen += self.counts[b]
            if seen >= rank:
                return _upper_s(b)
        raise AssertionError("unreachable: ranks are within the total")

    def to_json(self) -> dict[str, object]:
        return {
            "counts": {str(k): v for k, v in self.counts.items()},
            "total": self.total,
            "sum_s": self.sum_s,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> Histogram:
        raw = data["counts"]
        assert isinstance(raw, dict)
        total, sum_s = data["total"], data["sum_s"]
        assert isinstance(total, int)
        assert isinstance(sum_s, float | int)
        return cls({int(k): int(v) for k, v in raw.items()}, total, float(sum_s))


def merged(parts: Iterable[Mapping[str, Histogram]]) -> dict[str, Histogram]:
    out: dict[str, Histogram] = {}
    for part in parts:
        for name, h in part.items():
            out.setdefault(name, Histogram()).merge(h)
    return out


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of one process (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return None
    # The command may hold spaces and parentheses: fields start after the last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def pids_named(name: str) -> list[int]:
    """Processes whose command name is ``name`` (``postgres``, ``redis-server``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/comm") as f:
                if f.read().strip() == name:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def cpu_of(pids: Iterable[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        s = process_cpu_s(pid)
        if s is not None:
            out[pid] = s
    return out


def cpu_delta(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU seconds spent between two readings; a process new in ``after`` counts from 0, one
    gone from it (exited meanwhile) is lost, which a reading cannot help."""
    return sum(s - before.get(pid, 0.0) for pid, s in after.items())


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        parts = [int(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    total = sum(parts[:8])
    return (total - idle) / _TICKS, total / _TICKS
