"""One protection scenario against a running engine: the engine's counters and load as the
scenario reads them, and :func:`run_scenario`, which starts the batch load, replays the
interactive trace over the measured window and lets the engine drain.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Sequence

import httpx

from backfill_analysis.simulate.trace import TraceRequest
from bench.protection import cpu_share
from bench.protection.record import Config, ScenarioResult, say
from bench.protection.replay import (
    FloodStats,
    InteractiveResult,
    Target,
    flood,
    replay,
    summarisation_body,
)
from bench.protection.split import ENGINE_SPLIT_COUNTERS, SCHEDULER_SPLIT_COUNTERS
from bench.stack import BackfillStack, counters
from devkit import devengine

ENGINE_COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
    *ENGINE_SPLIT_COUNTERS,
)


async def engine_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    return counters((await client.get(f"{url}/metrics")).text, ENGINE_COUNTERS)


SCHEDULER_COUNTERS = [
    "backfill_sched_steps_total",
    "backfill_sched_batch_paused_steps_total",
    "backfill_sched_batch_tokens_held_total",
    "backfill_sched_batch_pauses_total",
    "backfill_sched_batch_relief_total",
    "backfill_sched_batch_preemptions_total",
    *SCHEDULER_SPLIT_COUNTERS,
]


async def scheduler_counters(client: httpx.AsyncClient, url: str | None) -> dict[str, float]:
    """The step scheduler's counters (none for a stock engine)."""
    if url is None:
        return {}
    return counters((await client.get(url)).text, SCHEDULER_COUNTERS)


async def engine_load(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    text = (await client.get(f"{url}/metrics")).text
    got = counters(text, ["vllm:num_requests_running", "vllm:num_requests_waiting"])
    return got["vllm:num_requests_running"], got["vllm:num_requests_waiting"]


async def _sample_load(url: str, into: list[tuple[float, float]]) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            await asyncio.sleep(1.0)
            try:
                into.append(await engine_load(client, url))
            except httpx.HTTPError:
                continue


async def _wait_steady(url: str, tokens: float, timeout_s: float) -> float:
    """Until the engine has generated ``tokens`` more tokens: the batch load's first wave is
    all prefill (32 prompts of ~475 tokens take 15-60 s here), so a window opened before one
    wave has finished would count prefill time without its decode. Returns the wait."""
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        base = (await engine_counters(client, url))["vllm:generation_tokens_total"]
        while time.monotonic() - started < timeout_s:
            await asyncio.sleep(1.0)
            now = (await engine_counters(client, url))["vllm:generation_tokens_total"]
            if now - base >= tokens:
                break
        else:
            say(f"the batch load made under {tokens:.0f} tokens in {timeout_s:.0f} s")
    return time.monotonic() - started


async def wait_idle(url: str, timeout_s: float) -> bool:
    """Until nothing runs or waits in the engine, twice in a row; whether it got there."""
    quiet = 0
    async with httpx.AsyncClient(timeout=10) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            running, waiting = await engine_load(client, url)
            quiet = quiet + 1 if running + waiting == 0 else 0
            if quiet >= 2:
                return True
            await asyncio.sleep(0.5)
    return False


async def run_scenario(
    name: str,
    server: devengine.EngineServer,
    policy: str,
    cfg: Config,
    requests: Sequence[TraceRequest],
    *,
    interactive: Target | None,
    batch: str | None,
    stack: BackfillStack | None = None,
    overrides: dict[str, str] | None = None,
) -> ScenarioResult:
    """Start the batch load (if any), let it warm up, replay the trace (or wait as long),
    read the engine's counters around that window, stop the batch and let the engine drain."""
    url, model = server.url, server.served_model_name
    span = requests[-1].arrival_s if requests else 0.0
    flood_task: asyncio.Task[None] | None = None
    flood_stats = FloodStats()
    batch_id: str | None = None
    if not await wait_idle(url, cfg.drain_timeout_s):
        say(f"{name}: the engine was still busy at the start")
    if batch == "straight":
        flood_task = asyncio.create_task(
            flood(
                url,
                model,
                concurrency=cfg.concurrency,
                priority=cfg.batch_priority,
                prompt_chars=cfg.batch_prompt_chars,
                max_tokens=cfg.batch_max_tokens,
                stats=flood_stats,
            )
        )
    elif batch == "backfill":
        assert stack is not None
        # Enough items that the job cannot run dry inside the window even at 4 items/s.
        n = int(4 * (cfg.warmup_s + 2 * span + 90))
        bodies = [
            summarisation_body(model, i, cfg.batch_prompt_chars, cfg.batch_max_tokens, name)
            for i in range(n)
        ]
        batch_id = await asyncio.to_thread(stack.submit, bodies)
    steady_after = 0.0
    if batch is not None:
        steady_after = await _wait_steady(url, cfg.concurrency * cfg.batch_max_tokens, 600)
        await asyncio.sleep(cfg.warmup_s)
    samples: list[tuple[float, float]] = []
    sampler = asyncio.create_task(_sample_load(url, samples))
    async with httpx.AsyncClient(timeout=30) as client:
        before = await engine_counters(client, url)
        bf_before = await asyncio.to_thread(stack.metrics) if stack else {}
        att_before = await asyncio.to_thread(stack.preempted_attempts) if stack else (0, 0)
        sched_before = await scheduler_counters(client, server.scheduler_metrics_url)
        cpu_before = cpu_share.snapshot()
        t0 = time.monotonic()
        results: list[InteractiveResult] | None = None
        if interactive is not None:
            results = await replay(requests, interactive)
        else:
            # Straight batch runs in synchronised waves (all prefill, then all decode); a window
            # shorter than a few waves measures the phase it happened to fall in.
            await asyncio.sleep(max(span, cfg.batch_window_s))
        window = time.monotonic() - t0
        cpu_after = cpu_share.snapshot()
        after = await engine_counters(client, url)
        sched_after = await scheduler_counters(client, server.scheduler_metrics_url)
        bf_after = await asyncio.to_thread(stack.metrics) if stack else {}
        att_after = await asyncio.to_thread(stack.preempted_attempts) if stack else (0, 0)
    sampler.cancel()
    loadavg = os.getloadavg()
    roots = {
        "engine_api": [server.pid],
        "engine_core": [pid for pid, p in cpu_after.items() if p.ppid == server.pid],
        "backfill": list(stack.pids.values()) if stack is not None else [],
    }
    cpu = cpu_share.shares(cpu_before, cpu_after, window, roots, os.getpid())
    if flood_task is not None:
        flood_task.cancel()
        await asyncio.gather(flood_task, return_exceptions=True)
    if batch_id is not None and stack is not None:
        await asyncio.to_thread(stack.cancel, batch_id)
    drained = await wait_idle(url, cfg.drain_timeout_s)
    load: dict[str, float] = {"drained_after": float(drained), "steady_after_s": steady_after}
    if samples:
        load["running_mean"] = statistics.fmean(s[0] for s in samples)
        load["waiting_mean"] = statistics.fmean(s[1] for s in samples)
    if flood_task is not None:
        load["flood_completed"] = flood_stats.completed
        load["flood_errors"] = flood_stats.errors
    backfill: dict[str, float] = {}
    if stack is not None:
        backfill = {k: bf_after[k] - bf_before.get(k, 0.0) for k in bf_after}
        backfill["preempted_attempts"] = att_after[0] - att_before[0]
        backfill["recomputed_tokens_on_resume"] = att_after[1] - att_before[1]
    result = ScenarioResult(
        name=name,
        policy=policy,
        interactive=results,
        batch=batch,
        window_s=window,
        engine={k: after[k] - before[k] for k in ENGINE_COUNTERS},
        load=load,
        backfill=backfill,
        overrides=dict(overrides or {}),
        loadavg=(round(loadavg[0], 1), round(loadavg[1], 1), round(loadavg[2], 1)),
        cpu=cpu,
        scheduler={k: v - sched_before.get(k, 0.0) for k, v in sched_after.items()},
    )
    s = result.summary()
    say(
        f"{name}: window {window:.1f} s, TTFT p50/p99 {s['ttft_p50_s']}/{s['ttft_p99_s']}, "
        f"rejected {s['interactive_rejected']}, failed {s['interactive_failed']}, "
        f"batch tok/s {s['batch_output_tokens_per_s']}, "
        f"engine preemptions {s['engine_preemptions']:.0f}, load {loadavg[0]:.1f}; cores "
        + ", ".join(f"{role} {cores:.2f}" for role, cores in cpu.items())
    )
    return result
