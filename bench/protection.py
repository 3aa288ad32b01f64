"""Interactive protection: interactive time to first token while batch work shares the engine,
Backfill against vLLM's own priority scheduling and against fcfs, all in one run.

Interactive load: a request trace (``TIMESTAMP,ContextTokens,GeneratedTokens``; by default
rows 201-2,200 of the Azure code trace bundled in ``backfill_analysis/traces/``; prompts clipped
to 1,500 tokens, outputs to 64 exactly) replayed open loop, streaming, at priority 0. Its
arrivals are stretched so that interactive alone keeps the engine ~30% busy on *this* machine:
a short probe measures the engine's prefill and decode speed first, and the stretch is sized
from it (:mod:`bench.protection_plan`; ``--time-scale`` fixes it instead). The share of the
window interactive alone kept the engine busy is printed; when interactive alone was itself
overloaded the run gives no verdict. Batch load: summarisation chat requests (~475 prompt
tokens, 64 out) that keep the engine busy. Scenarios:

``alone``           interactive straight to vLLM, nothing else (the baseline)
``gateway``         interactive through Backfill's gateway, nothing else
``batch-straight``  batch alone, straight to vLLM at concurrency 32, priority 10
``batch-backfill``  batch alone, as a Backfill job run by a Backfill worker
``a``               Backfill: interactive through the gateway + the Backfill batch job
``b``               batch straight (concurrency 32, priority 10) + interactive straight
``c``               as ``b`` on a second server started with ``--scheduling-policy fcfs``
``alone-sched``     as ``alone`` on the Backfill engine, with ``--scheduler-cls`` only

The peers (``alone``, ``b``, ``batch-straight``) run on a stock priority server, ``c`` on an
fcfs one; the Backfill scenarios (``gateway``, ``batch-backfill``, ``a``) and ``alone-sched``
run on a server of their own with Backfill's step scheduler (its metrics handed to the
worker), or with ``--scheduler-cls NAME``; ``--scheduler-cls none`` runs them on the stock
server too (the work budget then preempts for TTFT, as before the scheduler).
Each batch scenario first lets the batch load run for a warm-up, then the measured window is
the interactive replay (or, for batch alone, the same length of time). Batch output tokens/s
is the engine's ``vllm:generation_tokens_total`` over the window less the interactive
requests' own tokens, so every scenario is counted the same way.

``a`` runs once per ``--variant NAME:KEY=VALUE,...`` (settings overrides given to the API and
the worker as ``BACKFILL_*`` variables; the first variant is the headline), so a sweep of
admission settings gives a curve of batch throughput against interactive TTFT p99, e.g.::

    python -m bench.protection --scenarios alone,batch-backfill,a \
        --variant budget --variant off:work_budget_enabled=false \
        --variant target2s:interactive_ttft_target_s=2

Each variant gets a fresh API, worker, scratch database and ledger namespace on the same
engine; ``goals`` in ``bench/out/protection.json`` has each variant's TTFT p99 ratio and the
share of standalone batch throughput it kept.

The closing line judges the headline ``a`` on all three goals at once: TTFT p50 and p99 <=
1.1x of interactive alone and batch kept >= 0.6 of Backfill's batch alone; its figure is the
worst of p50/1.1, p99/1.1 and 0.6/kept (ok at <= 1). Beside it: recomputed batch tokens as a
share of the batch tokens the engine processed, and interactive ITL p99 against alone.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from backfill_analysis.simulate.trace import (
    AZURE_CODE_TRACE,
    TraceOptions,
    TraceRequest,
    load_trace,
)
from bench import cpu_share
from bench import protection_plan as plan
from bench.common import OUT_DIR, finish, machine, parser, percentile, table
from bench.replay import FloodStats, InteractiveResult, Target, flood, replay, summarisation_body
from bench.stack import BackfillStack, counters
from worker import devengine
from worker.enginespeed import EngineSpeed, measure_speed

NAME = "protection"
TRACE = AZURE_CODE_TRACE
# The default trace's first 200 rows are one burst; the next 2,000 (18:20:23-18:31:25) are the
# replayed slice.
TRACE_SKIP, TRACE_ROWS = 200, 2000
PLOT = Path(__file__).parent / "protection.png"
GOAL_TTFT_RATIO = plan.GOAL_TTFT_RATIO
GOAL_BATCH_KEPT = plan.GOAL_BATCH_KEPT
SCENARIOS = ("alone", "gateway", "batch-straight", "batch-backfill", "a", "b", "c", "alone-sched")
BACKFILL_ENGINE_SCENARIOS = frozenset({"gateway", "batch-backfill", "a", "alone-sched"})
ENGINE_COUNTERS = (
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:prefix_cache_hits_total",
)


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
    """Cores each role used over the window (:mod:`bench.cpu_share`)."""
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


# ---------------------------------------------------------------------------------------------
# The engine as the scenarios see it


async def engine_counters(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    return counters((await client.get(f"{url}/metrics")).text, ENGINE_COUNTERS)


SCHEDULER_COUNTERS = [
    "backfill_sched_steps_total",
    "backfill_sched_batch_paused_steps_total",
    "backfill_sched_batch_tokens_held_total",
    "backfill_sched_batch_pauses_total",
    "backfill_sched_batch_relief_total",
    "backfill_sched_batch_preemptions_total",
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
            _say(f"the batch load made under {tokens:.0f} tokens in {timeout_s:.0f} s")
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


def _say(message: str) -> None:
    print(f"[protection] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# One scenario


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
        _say(f"{name}: the engine was still busy at the start")
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
    _say(
        f"{name}: window {window:.1f} s, TTFT p50/p99 {s['ttft_p50_s']}/{s['ttft_p99_s']}, "
        f"rejected {s['interactive_rejected']}, failed {s['interactive_failed']}, "
        f"batch tok/s {s['batch_output_tokens_per_s']}, "
        f"engine preemptions {s['engine_preemptions']:.0f}, load {loadavg[0]:.1f}; cores "
        + ", ".join(f"{role} {cores:.2f}" for role, cores in cpu.items())
    )
    return result


# ---------------------------------------------------------------------------------------------
# The run


def gateway_target(stack: BackfillStack, model: str) -> Target:
    return Target(stack.base, model, headers=stack.auth, priority=None)


@dataclass(frozen=True)
class Load:
    """The interactive load of this run, sized once on the first engine started."""

    speed: EngineSpeed
    stretch: plan.Stretch

    @property
    def requests(self) -> list[TraceRequest]:
        return self.stretch.requests

    def median_prefill_s(self) -> float:
        prompts = sorted(r.prompt_tokens for r in self.requests) or [0]
        return prompts[len(prompts) // 2] / self.speed.prefill_tokens_per_s


def size_load(server: devengine.EngineServer, cfg: Config, trace: Sequence[TraceRequest]) -> Load:
    """Probe the engine (a few seconds) and stretch ``trace`` to the planned busy share."""
    speed = measure_speed(server.url, server.served_model_name)
    stretch = plan.size_stretch(
        trace,
        speed.seconds_for,
        cfg.duration_s,
        target_busy=cfg.target_busy,
        time_scale=cfg.time_scale,
    )
    how = "sized" if stretch.sized else "given"
    _say(
        f"engine: {speed}; time stretch x{stretch.time_scale:.3g} ({how}): "
        f"{len(stretch.requests)} interactive requests in {cfg.duration_s:.0f} s, planned "
        f"busy {stretch.planned_busy:.0%} (target {cfg.target_busy:.0%})"
    )
    if not stretch.requests:
        raise SystemExit("no interactive requests in the window: a longer --duration?")
    if len(stretch.requests) < 10:
        _say(
            f"only {len(stretch.requests)} interactive requests fit this engine's window: "
            "its percentiles are a few requests' (a longer --duration gives more)"
        )
    return Load(speed, stretch)


def scheduler_policy(scheduler_cls: str) -> str:
    """How the table names an engine started with ``--scheduler-cls``."""
    return f"priority+{scheduler_cls.rpartition('.')[2] or scheduler_cls}"


def run_all(
    cfg: Config,
    trace: Sequence[TraceRequest],
    wanted: Sequence[str],
    variants: Sequence[Variant],
    logs: Path,
) -> tuple[list[ScenarioResult], dict[str, float], Load]:
    results: list[ScenarioResult] = []
    starts: dict[str, float] = {}
    loads: list[Load] = []

    def load_on(server: devengine.EngineServer) -> Load:
        if not loads:
            loads.append(size_load(server, cfg, trace))
        return loads[0]

    def own_engine(name: str) -> bool:
        return cfg.scheduler_cls is not None and name in BACKFILL_ENGINE_SCENARIOS

    if "alone-sched" in wanted and cfg.scheduler_cls is None:
        _say("alone-sched needs --scheduler-cls: left out")
    stock = [s for s in wanted if s not in ("c", "alone-sched") and not own_engine(s)]
    if stock:
        server = devengine.start_model(cfg.model, kv_cache_gib=cfg.kv_cache_gib)
        starts["priority"] = server.ready_seconds
        try:
            requests = load_on(server).requests
            straight = Target(server.url, server.served_model_name, priority=0)

            def one(name: str, **kw: Any) -> None:
                results.append(
                    asyncio.run(run_scenario(name, server, "priority", cfg, requests, **kw))
                )

            if "alone" in wanted:
                one("alone", interactive=straight, batch=None)
            if "b" in wanted:
                one("b", interactive=straight, batch="straight")
            if "batch-straight" in wanted:
                one("batch-straight", interactive=None, batch="straight")
            if cfg.scheduler_cls is None:
                _backfill_scenarios(one, server, wanted, variants, logs)
        finally:
            server.stop()
    if cfg.scheduler_cls is not None and any(own_engine(s) for s in wanted):
        policy = scheduler_policy(cfg.scheduler_cls)
        ours = cfg.scheduler_cls == devengine.SCHEDULER_CLS
        server = devengine.start_model(
            cfg.model,
            kv_cache_gib=cfg.kv_cache_gib,
            # Backfill's own: its package on the engine's path and its metrics on a port the
            # worker is told of; another class is passed through as it is.
            scheduler=ours,
            extra_args=[] if ours else ["--scheduler-cls", cfg.scheduler_cls],
        )
        starts[policy] = server.ready_seconds
        try:
            requests = load_on(server).requests

            def on_own(name: str, **kw: Any) -> None:
                results.append(asyncio.run(run_scenario(name, server, policy, cfg, requests, **kw)))

            if "alone-sched" in wanted:
                straight = Target(server.url, server.served_model_name, priority=0)
                on_own("alone-sched", interactive=straight, batch=None)
            _backfill_scenarios(on_own, server, wanted, variants, logs)
        finally:
            server.stop()
    if "c" in wanted:
        server = devengine.start_model(
            cfg.model,
            kv_cache_gib=cfg.kv_cache_gib,
            # The last --scheduling-policy on vLLM's command line wins.
            extra_args=["--scheduling-policy", "fcfs"],
        )
        starts["fcfs"] = server.ready_seconds
        try:
            requests = load_on(server).requests
            straight = Target(server.url, server.served_model_name, priority=0)
            results.append(
                asyncio.run(
                    run_scenario(
                        "c", server, "fcfs", cfg, requests, interactive=straight, batch="straight"
                    )
                )
            )
        finally:
            server.stop()
    if not loads:
        raise SystemExit("no scenario ran")
    return results, starts, loads[0]


def _backfill_scenarios(
    one: Any,
    server: devengine.EngineServer,
    wanted: Sequence[str],
    variants: Sequence[Variant],
    logs: Path,
) -> None:
    """``gateway``, ``batch-backfill`` and ``a`` (once per variant) on ``server``."""
    if not {"gateway", "batch-backfill", "a"} & set(wanted):
        return
    for i, variant in enumerate(variants):
        stack_logs = logs / f"backfill-{variant.name}"
        overrides = dict(variant.overrides)
        if server.scheduler_metrics_url is not None:
            # The worker reads the engine's scheduler and leaves interactive TTFT to it.
            overrides.setdefault("engine_scheduler_metrics_url", server.scheduler_metrics_url)
        with BackfillStack(server.url, stack_logs, overrides).running() as st:
            _say(f"Backfill up for variant {variant.name}: {st.base}")
            gw = gateway_target(st, server.served_model_name)
            label = "a" if i == 0 else f"a:{variant.name}"
            if i == 0 and "gateway" in wanted:
                one("gateway", interactive=gw, batch=None, stack=st)
            if i == 0 and "batch-backfill" in wanted:
                one("batch-backfill", interactive=None, batch="backfill", stack=st)
            if "a" in wanted:
                one(label, interactive=gw, batch="backfill", stack=st, overrides=variant.overrides)
        if "a" not in wanted:
            break


# ---------------------------------------------------------------------------------------------
# Report


def _fmt(v: float | None, digits: int = 2) -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}f}"


def rows(summaries: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    out = []
    for s in summaries:
        bf = s["backfill"]
        out.append(
            (
                s["scenario"],
                s["policy"],
                s["batch"] or "—",
                f"{s['interactive_ok']}/{s['interactive_requests']}"
                if s["interactive_requests"]
                else "—",
                f"{_fmt(s['ttft_p50_s'])} / {_fmt(s['ttft_p99_s'])}",
                _fmt(s["itl_p99_s"], 3),
                f"{s['interactive_busy']:.0%}" if s.get("interactive_busy") is not None else "—",
                f"{s['interactive_rejected']} / {s['interactive_failed']}"
                if s["interactive_requests"]
                else "—",
                _fmt(s["batch_output_tokens_per_s"], 1),
                _fmt(s.get("batch_tokens_processed_per_s"), 0),
                f"{s['engine_load']['running_mean']:.0f}"
                if "running_mean" in s["engine_load"]
                else "—",
                int(s["engine_preemptions"]),
                int(bf["backfill_gateway_batch_preemptions_total"]) if bf else "—",
                int(bf["recomputed_tokens_on_resume"]) if bf else "—",
                f"{s['loadavg_1m_5m_15m'][0]:.1f}",
                _cores(s.get("cpu_cores") or {}),
            )
        )
    return out


def _cores(cpu: dict[str, float]) -> str:
    """Cores the engine core and the engine's API process used / cores all else used."""
    if not cpu:
        return "—"
    beside = sum(v for k, v in cpu.items() if not k.startswith("engine"))
    return f"{cpu.get('engine_core', 0.0):.2f}+{cpu.get('engine_api', 0.0):.2f} / {beside:.2f}"


HEADERS = [
    "scenario", "engine", "batch", "int ok", "TTFT p50 / p99 s", "ITL p99 s", "int busy",
    "rejected / failed", "batch out tok/s", "batch all tok/s", "running", "engine preempt",
    "Backfill preempt", "recomputed tok", "load 1m", "cores core+api / beside",
]  # fmt: skip


def plot(summaries: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib  # noqa: PLC0415 - plotting loads only when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    points = tradeoff_points(summaries)
    fig, axes = plt.subplots(1, 3 if points else 2, figsize=(16.5 if points else 11, 4.6))
    cdf, bars = axes[0], axes[1]
    for s in summaries:
        ttfts = sorted(r["ttft_s"] for r in s["requests"] if r["ttft_s"] is not None)
        if not ttfts:
            continue
        ys = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
        cdf.step(ttfts, ys, where="post", label=f"{s['scenario']} (p99 {s['ttft_p99_s']:.2f} s)")
    cdf.set_xlabel("interactive time to first token (s)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("Interactive TTFT, CDF per scenario", fontsize=10)
    cdf.grid(alpha=0.3)
    if cdf.get_legend_handles_labels()[0]:
        cdf.legend(fontsize=8, loc="lower right")
    batch = [s for s in summaries if s["batch_output_tokens_per_s"] is not None]
    names = [s["scenario"] for s in batch]
    values = [s["batch_output_tokens_per_s"] for s in batch]
    colours = ["#2b6cb0" if s["batch"] == "backfill" else "#a0aec0" for s in batch]
    bars.bar(names, values, color=colours)
    for x, v in enumerate(values):
        bars.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
    bars.set_ylabel("batch output tokens/s (engine count)")
    bars.set_title("Batch throughput per scenario (blue: through Backfill)", fontsize=10)
    bars.tick_params(axis="x", labelsize=8, rotation=20)
    if points:
        plot_tradeoff(axes[2], points)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tradeoff(ax: Any, points: Sequence[dict[str, Any]]) -> None:
    """Batch kept against interactive TTFT p99, one point per scenario that ran both: the
    Backfill variants joined in order of the batch they kept, the peers apart."""
    ours = sorted((p for p in points if p["batch"] == "backfill"), key=lambda p: p["batch_kept"])
    peers = [p for p in points if p["batch"] != "backfill"]
    if ours:
        ax.plot(
            [p["batch_kept"] for p in ours],
            [p["ttft_p99_ratio"] for p in ours],
            "o-",
            color="#2b6cb0",
            label="Backfill (settings swept)",
        )
    for p in peers:
        ax.plot([p["batch_kept"]], [p["ttft_p99_ratio"]], "s", color="#a0aec0")
    for p in points:
        ax.annotate(
            p["label"],
            (p["batch_kept"], p["ttft_p99_ratio"]),
            textcoords="offset points",
            xytext=(4, 4),
            fontsize=8,
        )
    ax.axhline(1.0, color="black", lw=0.6)
    ax.axhline(GOAL_TTFT_RATIO, color="grey", ls="--", lw=0.8, label="TTFT goal (issue 7)")
    ax.axhline(1.1, color="grey", ls=":", lw=0.8, label="TTFT goal (issue 12)")
    ax.axvline(GOAL_BATCH_KEPT, color="grey", ls="-.", lw=0.8, label="batch kept goal")
    ax.set_xlabel("batch throughput kept (share of the same path's batch alone)")
    ax.set_ylabel("interactive TTFT p99 / interactive alone")
    ax.set_title("Trade-off: batch kept vs interactive TTFT p99 (grey: vLLM alone)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")


def tradeoff_points(summaries: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mixed scenario (``a``, its variants, ``b``, ``c``) as a point of the trade-off:
    interactive TTFT p50/p99 over interactive alone's, and batch throughput over the same
    path's batch alone (Backfill's over ``batch-backfill``, the peers' over
    ``batch-straight``). Scenarios without the figures they need are left out."""
    by = _by_name(summaries)
    alone = by.get("alone", {})
    a50, a99 = alone.get("ttft_p50_s"), alone.get("ttft_p99_s")
    flat = {
        "backfill": by.get("batch-backfill", {}).get("batch_output_tokens_per_s"),
        "straight": by.get("batch-straight", {}).get("batch_output_tokens_per_s"),
    }
    out = []
    for s in summaries:
        name = s["scenario"]
        if not (name in ("a", "b", "c") or name.startswith("a:")):
            continue
        base = flat.get(s["batch"] or "")
        p50, p99, tps = s["ttft_p50_s"], s["ttft_p99_s"], s["batch_output_tokens_per_s"]
        if not (a50 and a99 and base and p50 is not None and p99 is not None and tps is not None):
            continue
        label = name
        if name == "a":
            label = "a (" + (",".join(f"{k}={v}" for k, v in s["overrides"].items()) or "defaults")
            label += ")"
        out.append(
            {
                "scenario": name,
                "label": label,
                "batch": s["batch"],
                "overrides": s["overrides"],
                "ttft_p50_ratio": p50 / a50,
                "ttft_p99_ratio": p99 / a99,
                "batch_kept": tps / base,
            }
        )
    return out


def _by_name(summaries: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s["scenario"]: s for s in summaries}


def verdicts(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, each None when a scenario it needs was not run."""
    by = _by_name(summaries)

    def get(name: str, key: str) -> float | None:
        v = by.get(name, {}).get(key)
        return float(v) if v is not None else None

    def ratio(num: float | None, den: float | None) -> float | None:
        return num / den if num is not None and den else None

    alone, a = get("alone", "ttft_p99_s"), get("a", "ttft_p99_s")
    out: dict[str, Any] = {
        "ttft_p50_ratio": ratio(get("a", "ttft_p50_s"), get("alone", "ttft_p50_s")),
        "ttft_p99_ratio": ratio(a, alone),
        "itl_p99_ratio": ratio(get("a", "itl_p99_s"), get("alone", "itl_p99_s")),
    }
    for peer in ("b", "c"):
        theirs = get(peer, "ttft_p99_s")
        out[f"a_ttft_p99_below_{peer}"] = a < theirs if a is not None and theirs else None
    bf_alone, bf_a = (
        get("batch-backfill", "batch_output_tokens_per_s"),
        get("a", "batch_output_tokens_per_s"),
    )
    out["batch_kept_a"] = ratio(bf_a, bf_alone)
    a_row = by.get("a", {})
    recomputed = (a_row.get("backfill") or {}).get("recomputed_tokens_on_resume")
    out["recomputed_share_a"] = ratio(
        float(recomputed) if recomputed is not None else None, get("a", "batch_tokens_processed")
    )
    straight = get("batch-straight", "batch_output_tokens_per_s")
    out["batch_backfill_vs_straight"] = ratio(bf_alone, straight)
    # Prompt and output tokens together: a window shorter than a few of straight's waves
    # (all prefill, then all decode) catches one phase, and output tokens alone then judge
    # the phase rather than the work done.
    out["batch_backfill_vs_straight_all_tokens"] = ratio(
        get("batch-backfill", "batch_tokens_processed_per_s"),
        get("batch-straight", "batch_tokens_processed_per_s"),
    )
    for name in ("b", "c"):
        out[f"batch_kept_{name}"] = ratio(get(name, "batch_output_tokens_per_s"), straight)
    out["alone_sched_ttft_p50_ratio"] = ratio(
        get("alone-sched", "ttft_p50_s"), get("alone", "ttft_p50_s")
    )
    out["alone_sched_ttft_p99_ratio"] = ratio(get("alone-sched", "ttft_p99_s"), alone)
    for s in summaries:
        if s["scenario"].startswith("a:") and alone:
            p99 = s["ttft_p99_s"]
            tps = s["batch_output_tokens_per_s"]
            out[f"{s['scenario']}_ttft_p99_ratio"] = p99 / alone if p99 is not None else None
            out[f"{s['scenario']}_batch_kept"] = tps / bf_alone if tps and bf_alone else None
    return out


def closing_verdict(
    summaries: Sequence[dict[str, Any]], goals: dict[str, Any], median_prefill_s: float
) -> plan.Verdict:
    """The headline ``a`` judged on TTFT p50, p99 and batch kept together, or no verdict
    when interactive alone was itself overloaded."""
    alone = _by_name(summaries).get("alone", {})
    overloaded = plan.overload_reason(
        alone.get("interactive_busy"), alone.get("ttft_p50_s"), median_prefill_s
    )
    return plan.verdict(
        goals["ttft_p50_ratio"], goals["ttft_p99_ratio"], goals["batch_kept_a"], overloaded
    )


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


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--model", default="smollm2", help="smollm2 (default) or tiny (smoke test)")
    p.add_argument("--trace", type=Path, default=TRACE, help="a TIMESTAMP,ContextTokens,"
                   f"GeneratedTokens CSV (default the bundled {TRACE.name})")  # fmt: skip
    p.add_argument(
        "--skip",
        type=int,
        default=None,
        help=f"trace rows to skip (default {TRACE_SKIP} of the bundled trace, else 0)",
    )
    p.add_argument(
        "--rows",
        type=int,
        default=None,
        help=f"trace rows to keep after those (default {TRACE_ROWS} of the bundled trace, "
        "else all)",
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="stretch arrivals by this much (default: sized from the probed engine so that "
        "interactive alone keeps it --target-busy busy)",
    )
    p.add_argument(
        "--target-busy",
        type=float,
        default=plan.TARGET_BUSY,
        help=f"share of the window interactive alone keeps the engine busy ({plan.TARGET_BUSY})",
    )
    p.add_argument("--max-prompt", type=int, default=1500, help="clip prompts (1500 tokens)")
    p.add_argument("--max-output", type=int, default=64, help="clip outputs (64 tokens)")
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds of (scaled) trace per scenario; default 90, --quick 30",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds the batch runs before the window (default 10, --quick 5)",
    )
    p.add_argument("--concurrency", type=int, default=32, help="straight batch concurrency")
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument(
        "--scheduler-cls",
        default=devengine.SCHEDULER_CLS,
        metavar="NAME",
        help="vLLM --scheduler-cls for the engine the Backfill scenarios (and alone-sched) "
        "run on; the others stay on the stock engine (default: Backfill's step scheduler, "
        "its metrics handed to the worker; 'none': the stock engine for all)",
    )
    p.add_argument(
        "--scenarios",
        default=None,
        help=f"comma-separated subset of {','.join(SCENARIOS)} (default: all; alone-sched "
        "only with --scheduler-cls)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="run scenario a with these Backfill settings (repeatable; the first "
        "is the headline; default one variant 'default' with no overrides)",
    )
    p.add_argument(
        "--plot",
        type=Path,
        default=None,
        help=f"PNG path (default {PLOT.name} beside this file; --quick: bench/out/)",
    )
    args = p.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the engines, the API and worker processes, the scratch
    # database and the ledger keys are all cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    default_scenarios = [
        s for s in SCENARIOS if s != "alone-sched" or args.scheduler_cls not in (None, "none")
    ]
    chosen = args.scenarios or ",".join(default_scenarios)
    wanted = [s.strip() for s in chosen.split(",") if s.strip()]
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenarios: {', '.join(sorted(unknown))}")
    variants = [parse_variant(v) for v in args.variant] or [Variant("default", {})]
    duration = args.duration or (30.0 if args.quick else 90.0)
    # Unstretched and unwindowed: the stretch is sized once the engine's speed is known.
    bundled = args.trace == TRACE
    options = TraceOptions(
        max_prompt_tokens=args.max_prompt,
        max_output_tokens=args.max_output,
        skip=args.skip if args.skip is not None else (TRACE_SKIP if bundled else 0),
        rows=args.rows if args.rows is not None else (TRACE_ROWS if bundled else None),
    )
    trace = load_trace(args.trace, options)
    if not trace:
        raise SystemExit(f"no requests in {args.trace} with {options}")
    cfg = Config(
        model=args.model,
        trace=options,
        trace_path=args.trace,
        warmup_s=args.warmup if args.warmup is not None else (5.0 if args.quick else 10.0),
        concurrency=args.concurrency,
        batch_priority=10,
        batch_prompt_chars=1700,
        batch_max_tokens=64,
        kv_cache_gib=args.kv_cache_gib,
        duration_s=duration,
        time_scale=args.time_scale,
        target_busy=args.target_busy,
        scheduler_cls=None if args.scheduler_cls in (None, "none") else args.scheduler_cls,
        batch_window_s=60.0 if args.quick else 90.0,
    )
    _say(
        f"trace {args.trace.name}: {len(trace)} requests over {trace[-1].arrival_s:.0f} s, "
        f"mean prompt {statistics.fmean(r.prompt_tokens for r in trace):.0f}, mean output "
        f"{statistics.fmean(r.output_tokens for r in trace):.1f} tokens (clipped)"
    )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_start = os.getloadavg()
    logs = OUT_DIR / "protection-logs"
    results, starts, load = run_all(cfg, trace, wanted, variants, logs)
    summaries = [r.summary() for r in results]
    print(table(HEADERS, rows(summaries)))
    goals = verdicts(summaries)
    for key, value in goals.items():
        print(f"{key}: {_fmt(value, 3) if isinstance(value, float) else value}")
    alone = _by_name(summaries).get("alone", {})
    busy = alone.get("interactive_busy")
    print(
        f"interactive load: x{load.stretch.time_scale:.3g} stretch, "
        f"{len(load.requests)} requests, planned busy {load.stretch.planned_busy:.0%}, reached "
        + (f"{busy:.0%}" if busy is not None else "— (alone not run)")
        + f" (engine: {load.speed})"
    )
    plot_path = args.plot or (PLOT if not args.quick else OUT_DIR / "protection-quick.png")
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(
        summaries,
        plot_path,
        f"Interactive protection, {cfg.model} on vLLM CPU, {duration:.0f} s of trace per "
        f"scenario (x{load.stretch.time_scale:.3g}), {machine()}",
    )
    print(f"plot: {plot_path}")
    command = "python -m bench.protection " + " ".join(sys.argv[1:] if argv is None else argv)
    judged = closing_verdict(summaries, goals, load.median_prefill_s())
    print(
        "goals (a): TTFT p50 and p99 <= "
        f"{GOAL_TTFT_RATIO}x alone, batch kept >= {GOAL_BATCH_KEPT}: p50 "
        f"{_fmt(goals['ttft_p50_ratio'])}x, p99 {_fmt(goals['ttft_p99_ratio'])}x, kept "
        f"{_fmt(goals['batch_kept_a'])}; beside: recomputed "
        + (f"{goals['recomputed_share_a']:.1%}" if goals["recomputed_share_a"] is not None else "—")
        + f" of batch tokens processed, ITL p99 {_fmt(goals['itl_p99_ratio'])}x alone"
    )
    finish(
        NAME,
        "worst_goal_share",
        judged.worst,
        "<=",
        1.0,
        {
            "command": command.strip(),
            "started": started,
            "loadavg_at_start": load_start,
            "loadavg_at_end": os.getloadavg(),
            "engine_ready_seconds": starts,
            "config": asdict(cfg) | {"trace_path": str(cfg.trace_path)},
            "engine_speed": asdict(load.speed),
            "time_scale": load.stretch.time_scale,
            "time_scale_sized": load.stretch.sized,
            "planned_busy": load.stretch.planned_busy,
            "reached_busy": busy,
            "variants": [asdict(v) for v in variants],
            "interactive_requests": len(load.requests),
            "goals": goals,
            "verdict": asdict(judged),
            "goal_ttft_ratio": GOAL_TTFT_RATIO,
            "goal_batch_kept": GOAL_BATCH_KEPT,
            "tradeoff": tradeoff_points(summaries),
            "plot": str(plot_path),
            "scenarios": summaries,
        },
        reason=judged.reason,
    )


if __name__ == "__main__":
    main()
