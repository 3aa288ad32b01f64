"""Where the machine's CPU went during a benchmark window, by role (Linux ``/proc``).

On a 2-core machine the engine shares its cores with everything else: Backfill's API and
worker, Postgres, Redis, the benchmark's own client. A GPU node's accelerator shares nothing
with them, so what they take here is a cost of this machine, not of the design; these figures
say how large it was. :func:`snapshot` reads every process's CPU time, :func:`shares` (pure)
turns two snapshots into cores used per role.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
BY_NAME = {"postgres": "postgres", "redis-server": "redis"}


@dataclass(frozen=True, slots=True)
class ProcessTime:
    ppid: int
    name: str
    cpu_s: float
    """User + system time so far."""


def _read(stat: Path) -> tuple[int, ProcessTime] | None:
    try:
        text = stat.read_text()
    except OSError:
        return None  # gone between listing and reading
    # pid (comm) state ppid ...: comm may hold spaces and parentheses.
    head, _, tail = text.rpartition(")")
    pid_text, _, name = head.partition(" (")
    fields = tail.split()
    try:
        return int(pid_text), ProcessTime(
            int(fields[1]), name, (int(fields[11]) + int(fields[12])) * TICK_S
        )
    except (IndexError, ValueError):
        return None


def snapshot(proc: Path = Path("/proc")) -> dict[int, ProcessTime]:
    """Every live process's parent, name and CPU time (empty where there is no ``/proc``)."""
    out: dict[int, ProcessTime] = {}
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if entry.name.isdigit():
            read = _read(entry / "stat")
            if read is not None:
                out[read[0]] = read[1]
    return out


def _role(pid: int, procs: Mapping[int, ProcessTime], roots: Mapping[int, str], client: int) -> str:
    seen = 0
    at: int | None = pid
    while at is not None and at > 1 and seen < 64:
        if at in roots:
            return roots[at]
        if at == client:
            return "client"
        p = procs.get(at)
        at = p.ppid if p is not None else None
        seen += 1
    p = procs.get(pid)
    return BY_NAME.get(p.name, "other") if p is not None else "other"


def shares(
    before: Mapping[int, ProcessTime],
    after: Mapping[int, ProcessTime],
    window_s: float,
    roots: Mapping[str, Sequence[int]],
    client: int,
) -> dict[str, float]:
    """Cores each role used over ``window_s``: a process belongs to the role of the nearest
    root (``roots``: role -> process ids) above it, else to ``client`` (this process and its
    children), else to Postgres or Redis by name, else ``other``. A process that started in
    the window counts from zero; one that ended in it is lost (short-lived helpers only)."""
    by_pid = {pid: role for role, pids in roots.items() for pid in pids}
    used: dict[str, float] = {}
    if window_s <= 0:
        return used
    for pid, now in after.items():
        then = before.get(pid)
        spent = now.cpu_s - (then.cpu_s if then is not None and then.name == now.name else 0.0)
        if spent <= 0:
            continue
        role = _role(pid, after, by_pid, client)
        used[role] = used.get(role, 0.0) + spent
    return {role: round(cpu / window_s, 3) for role, cpu in sorted(used.items())}
