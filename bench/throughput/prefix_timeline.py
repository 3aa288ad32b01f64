"""Where a ``bench.prefix`` side spends its time: attempts over time, from Postgres (the
Backfill sides) or the client's own clock, on one footing.

The ledger samples (``SideResult.concurrency``) and the client's count at each send are not
alike: the first counts leases (held from the reservation to the release after the result is
durable), the second is read only when a request goes out, never in the gaps. A
:class:`Timeline` counts sequences between their start and their end on either side, weighted
by time from the side's own zero (the job in progress; the client's first send), so the mean
running sequences of the two sides compare, and it says when the first started and how long
the side ran below its peak.

:class:`CpuWatch` says where the CPU went while a side ran: the engine's processes (its API
server and its engine core) and the whole machine, so a side the engine ran slower for can be
told apart as the engine doing more work (its API server streaming, answering ``/metrics``)
or the engine being starved (the other processes on the cores).

Pure except :func:`backfill_intervals` (one query) and :class:`CpuWatch`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import text

from backfill.store import Repository
from bench.throughput.engine import process_ticks


@dataclass(frozen=True)
class Timeline:
    seconds: float
    first_start_s: float
    peak: int
    mean_running: float
    """Sequences running, weighted by time over the whole side (from 0 to its end)."""
    below_peak_s: float
    """Time, after the first start, with fewer sequences running than the side's peak while
    items were still to start (the rest of the job's tail is not a fault of the feed)."""
    starts_by_tenth: list[int]
    """Starts in each tenth of a second from 0 (the feed's cadence)."""
    ends_by_tenth: list[int]
    """Ends in each tenth of a second from 0 (a Backfill attempt's when its result is
    durable): against the starts, how long a slot stayed empty."""

    def row(self) -> dict[str, Any]:
        return {
            "first_start_s": round(self.first_start_s, 3),
            "mean_running": round(self.mean_running, 2),
            "below_peak_s": round(self.below_peak_s, 3),
            "starts_by_tenth": self.starts_by_tenth,
            "ends_by_tenth": self.ends_by_tenth,
        }


def timeline(intervals: Sequence[tuple[float, float]], seconds: float) -> Timeline:
    """Attempts as (start, end) seconds from the side's zero, over a side of ``seconds``."""
    if not intervals:
        return Timeline(seconds, 0.0, 0, 0.0, 0.0, [], [])
    events = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals])
    last_start = max(s for s, _ in intervals)
    running = peak = 0
    area = below = 0.0
    at = 0.0
    levels: list[tuple[float, float, int]] = []
    for t, step in events:
        if t > at:
            area += running * (t - at)
            levels.append((at, t, running))
            at = t
        running += step
        peak = max(peak, running)
    first = min(s for s, _ in intervals)
    for t_from, t_to, level in levels:
        lo, hi = max(t_from, first), min(t_to, last_start)
        if hi > lo and level < peak:
            below += hi - lo
    tenths = [0] * (int(last_start * 10) + 1)
    for s, _ in intervals:
        tenths[max(0, int(s * 10))] += 1
    ends = [0] * (int(max(e for _, e in intervals) * 10) + 1)
    for _, e in intervals:
        ends[max(0, int(e * 10))] += 1
    mean = area / seconds if seconds > 0 else 0.0
    return Timeline(seconds, first, peak, mean, below, tenths, ends)


_ATTEMPTS = (
    "SELECT EXTRACT(EPOCH FROM (a.started_at - j.in_progress_at)), "
    "EXTRACT(EPOCH FROM (coalesce(a.ended_at, now()) - j.in_progress_at)) "
    "FROM attempts a JOIN items i ON i.id = a.item_id JOIN jobs j ON j.id = i.job_id "
    "WHERE i.job_id = :j ORDER BY a.started_at"
)

_PASS = (
    "SELECT EXTRACT(EPOCH FROM (prefixes_taken_at - in_progress_at)), "
    "EXTRACT(EPOCH FROM (prefixes_ended_at - in_progress_at)) FROM jobs WHERE id = :j"
)


def backfill_intervals(
    repo: Repository, job: str
) -> tuple[list[tuple[float, float]], tuple[float | None, float | None]]:
    """A job's attempts as (start, end) seconds from its move to in progress (Postgres'
    clock), and when its prefix pass was taken and ended (None: not recorded)."""
    with repo.engine.connect() as conn:
        rows = conn.execute(text(_ATTEMPTS), {"j": job}).all()
        taken, ended = conn.execute(text(_PASS), {"j": job}).one()
    return (
        [(float(s), float(e)) for s, e in rows],
        (
            None if taken is None else round(float(taken), 3),
            None if ended is None else round(float(ended), 3),
        ),
    )


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _cpu_s(
    table: dict[int, tuple[int, int, int]], engine_pgid: int, trees: dict[str, int]
) -> dict[str, float]:
    """CPU seconds of the engine's process group (it starts one of its own) apart: its leader
    (vLLM's API server: HTTP, streams, ``/metrics``) and the rest (its engine core); of each
    of ``trees`` (a process and its descendants); and of this process alone."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)

    def tree(root: int) -> int:
        total, todo = 0, [root]
        while todo:
            pid = todo.pop()
            total += table.get(pid, (0, 0, 0))[2]
            todo += children.get(pid, [])
        return total

    group = [(pid, ticks) for pid, (_, pgid, ticks) in table.items() if pgid == engine_pgid]
    out = {
        "engine_api": sum(t for pid, t in group if pid == engine_pgid),
        "engine_core": sum(t for pid, t in group if pid != engine_pgid),
        "bench": table.get(os.getpid(), (0, 0, 0))[2],
    } | {name: tree(pid) for name, pid in trees.items()}
    return {k: v * _TICK_S for k, v in out.items()}


def _machine_busy_s() -> float:
    user, nice, system, _idle, _iowait, irq, softirq = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]
    )
    return (user + nice + system + irq + softirq) * _TICK_S


class CpuWatch:
    """CPU seconds of the engine's processes, of other named process trees (the Backfill
    stack's API and worker), of this process and of the whole machine between :meth:`start`
    and :meth:`stop` (Linux: ``/proc``; a process that ended meanwhile is not counted)."""

    def __init__(self, engine_pid: int, trees: dict[str, int] | None = None) -> None:
        self.engine_pid = engine_pid
        self.trees = dict(trees or {})
        self._at: dict[str, float] = {}

    def _now(self) -> dict[str, float]:
        return _cpu_s(process_ticks(), self.engine_pid, self.trees) | {"machine": _machine_busy_s()}

    def start(self) -> None:
        self._at = self._now()

    def stop(self) -> dict[str, float]:
        now = self._now()
        return {f"{k}_cpu_s": round(v - self._at.get(k, 0.0), 2) for k, v in now.items()}
