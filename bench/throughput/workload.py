"""The throughput benchmark's workload: the summarisation requests every side sends (a fresh
random tag on every prompt, so no side gets prefix-cache help), the workload per model and
what one side's run measured (:class:`SideRun`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from devkit.demo_job import DOCS, PROMPT

GOAL = 0.9
TINY_GOAL = 0.75


SIDES = ("backfill", "run-batch", "direct")
STEP_SIDE = "backfill-step"
"""Backfill on an engine running its step scheduler (``--step-scheduler``)."""
STEP_GOAL = 0.98
"""Batch alone on the step scheduler's engine against the stock engine (issue 18)."""
_NOT_SIDE_CPU = {"cpu_s_process_with_start"}


@dataclass(frozen=True)
class Workload:
    model: str
    requests: int
    prompt_chars: int
    max_tokens: int
    rounds: int
    sweep: tuple[int, ...]
    sweep_requests: int
    kv_cache_gib: int
    goal: float


def workloads(quick: bool) -> list[Workload]:
    # KV space: 2 GiB gives smollm2 ~93k tokens, so Backfill's batch slack (75% after the
    # interactive reserve) still holds max_num_seqs of its ~600-token reservations.
    if quick:
        return [
            Workload("tiny", 300, 60, 32, 1, (32, 128, 256), 300, 1, TINY_GOAL),
            Workload("smollm2", 48, 1700, 64, 1, (32, 64), 32, 2, GOAL),
        ]
    return [
        Workload("tiny", 2000, 60, 32, 2, (32, 128, 256), 500, 1, TINY_GOAL),
        Workload("smollm2", 240, 1700, 64, 1, (32, 64), 64, 2, GOAL),
    ]


@dataclass
class SideRun:
    side: str
    model: str
    round: int
    requests: int
    seconds: float
    output_tokens: int
    prompt_tokens: int
    concurrency: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        """Output tokens per CPU second of the side's own processes (engine, vLLM API server,
        Backfill's API and worker or the client; Postgres and Redis not counted): how much
        work each token costs, which other people's load on the cores does not change."""
        cpu = sum(
            v for k, v in self.extra.items() if k.startswith("cpu_s_") and k not in _NOT_SIDE_CPU
        )
        return self.output_tokens / cpu if cpu > 0 else 0.0


def _corpus() -> str:
    return "\n\n".join(p.read_text().strip() for p in sorted(DOCS.glob("*.txt")))


def request_lines(w: Workload, served: str, n: int, tag: str) -> list[dict[str, Any]]:
    """``n`` OpenAI batch lines; each prompt starts with ``tag`` and its index (unique)."""
    corpus = _corpus()
    span = max(1, len(corpus) - w.prompt_chars)
    lines = []
    for i in range(n):
        start = (i * 7919) % span
        text = corpus[start : start + w.prompt_chars]
        body = {
            "model": served,
            "max_tokens": w.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [
                {"role": "user", "content": f"[{tag}-{i:05d}] " + PROMPT.format(text=text)}
            ],
        }
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return lines


def jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def usage_totals(bodies: Sequence[dict[str, Any]]) -> tuple[int, int]:
    out = sum(int(b["usage"]["completion_tokens"]) for b in bodies)
    prompt = sum(int(b["usage"]["prompt_tokens"]) for b in bodies)
    return out, prompt
