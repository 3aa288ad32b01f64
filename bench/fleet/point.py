"""What ``bench.fleet`` measures: the workload each simulated node runs (prompt and output
tokens, the request body), the calls it times, the goals, and one point of a sweep (N nodes on
one side, :class:`Point`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from bench.fleet.stats import Histogram

GOAL_ITEMS_PER_S = 10_000
GOAL_CLAIM_P99_S = 0.050
GOAL_RESERVE_P99_S = 0.005


PROMPT_TOKENS = 1000
OUTPUT_TOKENS = 300
BODY = json.dumps(
    {
        "model": "m",
        "max_tokens": OUTPUT_TOKENS,
        "messages": [{"role": "user", "content": "Summarise: " + "lorem ipsum " * 80}],
    }
)
"""A ~1 KB request body (a 1,000-token prompt would be ~4 KB; smaller keeps the load short)."""
CALLS = (
    "claim",
    "start",
    "reserve",
    "settle",
    "heartbeat",
    "heartbeat_pg",
    "finish",
    "release",
    "snapshot",
    "observe",
    "work_budget",
    "unclaim",
    "tick",
)


@dataclass
class Point:
    nodes: int
    side: str
    duration_s: float
    items_per_s: float
    started: int
    claims: int
    queued_left: int
    hist: dict[str, Histogram]
    pg_cpu: float
    """Postgres CPU seconds per second of the window (this database's backends + the
    server's background processes)."""
    redis_cpu: float
    harness_cpu: float
    machine_busy: float
    """The whole machine's busy cores over the window (ours and other helpers')."""
    extra: dict[str, Any] = field(default_factory=dict)

    def p(self, call: str, q: float) -> float:
        h = self.hist.get(call)
        return h.percentile(q) if h is not None and h.total else float("nan")

    def rate(self, call: str) -> float:
        h = self.hist.get(call)
        return (h.total / self.duration_s) if h is not None else 0.0
