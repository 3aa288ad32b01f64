"""The "TTFT split" table: where interactive requests' first-token time goes inside the engine,
each part's mean over a scenario's window.

On the step scheduler's engine (``a``, ``alone-sched``, ...) the class records it for
interactive requests only (``backfill_sched_interactive_PART_seconds``, see
``backfill_vllm.ttftsplit``): **step in flight** (from the front end's arrival to the end of
the step running then), **queueing** (further steps before the one carrying its first prompt
chunk starts), **prefill** (from that start to the end of the step giving its first token).
On the stock engine (``alone``, only interactive requests, so vLLM's histograms are theirs)
vLLM's own: ``vllm:request_queue_time_seconds`` (from the engine core's ``add_request`` to its
first schedule; a synchronous core takes a request only between steps, so the wait for the
step in flight comes before it and is not told apart) and
``vllm:request_prefill_time_seconds`` (first schedule to first token, as its front end sees
it). ``rest`` is the client's mean TTFT less the parts: the gateway, HTTP, tokenising, and on
the stock engine the step in flight.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from backfill_vllm.metrics import TTFT_PARTS
from bench.common import table

SCHED_FAMILIES = {part: f"backfill_sched_interactive_{part}_seconds" for part in TTFT_PARTS}
SCHEDULER_SPLIT_COUNTERS = [
    f"{name}_{end}" for name in SCHED_FAMILIES.values() for end in ("sum", "count")
]
VLLM_FAMILIES = {
    "queueing": "vllm:request_queue_time_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
}
ENGINE_SPLIT_COUNTERS = [
    f"{name}_{end}" for name in VLLM_FAMILIES.values() for end in ("sum", "count")
]


def _means(
    deltas: Mapping[str, float], families: Mapping[str, str]
) -> tuple[dict[str, float], int]:
    means: dict[str, float] = {}
    count = 0
    for part, name in families.items():
        n = deltas.get(f"{name}_count", 0.0)
        if n > 0:
            means[part] = deltas.get(f"{name}_sum", 0.0) / n
            count = max(count, int(n))
    return means, count


def ttft_split(
    engine: Mapping[str, float],
    scheduler: Mapping[str, float],
    interactive_only: bool,
    ttfts: Sequence[float],
) -> dict[str, Any]:
    """One scenario's split from its counter deltas: the step scheduler's where it ran, vLLM's
    where only interactive requests ran on a stock engine (``interactive_only``), else none."""
    means, count = _means(scheduler, SCHED_FAMILIES)
    source = "backfill_sched"
    if not count and interactive_only and not scheduler:
        means, count = _means(engine, VLLM_FAMILIES)
        source = "vllm"
    if not count:
        return {}
    out: dict[str, Any] = {"source": source, "requests": count}
    out |= {f"{part}_mean_s": means.get(part) for part in TTFT_PARTS}
    if ttfts:
        client = statistics.fmean(ttfts)
        out["client_ttft_mean_s"] = client
        out["rest_mean_s"] = client - sum(means.values())
    return out


HEADERS = (
    "scenario",
    "from",
    "n",
    "step in flight s",
    "queueing s",
    "prefill s",
    "rest s",
    "TTFT mean s",
)


def split_table(summaries: Sequence[Mapping[str, Any]]) -> str | None:
    """The "TTFT split" table (means per part, seconds), or None when no scenario has one."""
    rows = []
    for s in summaries:
        got = s.get("ttft_split") or {}
        if not got:
            continue
        rows.append(
            (
                s["scenario"],
                got["source"],
                got["requests"],
                *(_cell(got.get(f"{part}_mean_s")) for part in TTFT_PARTS),
                _cell(got.get("rest_mean_s")),
                _cell(got.get("client_ttft_mean_s")),
            )
        )
    if not rows:
        return None
    return "TTFT split (interactive, mean per request):\n" + table(HEADERS, rows)


def _cell(value: float | None) -> float | str:
    return "—" if value is None else value
