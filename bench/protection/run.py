"""The protection run: which engines start (stock priority, Backfill's step scheduler, fcfs),
the interactive load sized once on the first of them (:class:`Load`), and the scenarios run
on each, ``a`` once per settings variant on a fresh Backfill stack.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backfill_analysis.simulate.trace import TraceRequest
from bench.protection import plan
from bench.protection.record import Config, ScenarioResult, Variant, say
from bench.protection.replay import Target
from bench.protection.scenario import run_scenario
from bench.stack import BackfillStack
from devkit import devengine
from devkit.enginespeed import EngineSpeed, measure_speed

SCENARIOS = (
    "alone",
    "gateway",
    "batch-straight",
    "batch-backfill",
    "a",
    "b",
    "c",
    "alone-sched",
    "a-direct",
    "b-sched",
)
"""Not in the default set: ``a-direct``, ``a``'s batch job with the interactive requests sent
straight to the engine instead of through the gateway (the gateway's part in ``a``'s TTFT);
``b-sched``, ``b`` (interactive and a batch flood, both straight) on the step scheduler's
engine (Backfill's worker's part, against ``a-direct``)."""
EXTRA_SCENARIOS = frozenset({"a-direct", "b-sched"})
DEFAULT_SCENARIOS = tuple(s for s in SCENARIOS if s not in EXTRA_SCENARIOS)
BACKFILL_ENGINE_SCENARIOS = frozenset(
    {"gateway", "batch-backfill", "a", "alone-sched", "a-direct", "b-sched"}
)


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
    say(
        f"engine: {speed}; time stretch x{stretch.time_scale:.3g} ({how}): "
        f"{len(stretch.requests)} interactive requests in {cfg.duration_s:.0f} s, planned "
        f"busy {stretch.planned_busy:.0%} (target {cfg.target_busy:.0%})"
    )
    if not stretch.requests:
        raise SystemExit("no interactive requests in the window: a longer --duration?")
    if len(stretch.requests) < 10:
        say(
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
        say("alone-sched needs --scheduler-cls: left out")
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

            straight = Target(server.url, server.served_model_name, priority=0)
            if "alone-sched" in wanted:
                on_own("alone-sched", interactive=straight, batch=None)
            if "b-sched" in wanted:
                on_own("b-sched", interactive=straight, batch="straight")
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
    if not {"gateway", "batch-backfill", "a", "a-direct"} & set(wanted):
        return
    for i, variant in enumerate(variants):
        stack_logs = logs / f"backfill-{variant.name}"
        overrides = dict(variant.overrides)
        if server.scheduler_metrics_url is not None:
            # The worker reads the engine's scheduler and leaves interactive TTFT to it.
            overrides.setdefault("engine_scheduler_metrics_url", server.scheduler_metrics_url)
        with BackfillStack(server.url, stack_logs, overrides).running() as st:
            say(f"Backfill up for variant {variant.name}: {st.base}")
            gw = gateway_target(st, server.served_model_name)
            label = "a" if i == 0 else f"a:{variant.name}"
            if i == 0 and "gateway" in wanted:
                one("gateway", interactive=gw, batch=None, stack=st)
            if i == 0 and "batch-backfill" in wanted:
                one("batch-backfill", interactive=None, batch="backfill", stack=st)
            if "a" in wanted:
                one(label, interactive=gw, batch="backfill", stack=st, overrides=variant.overrides)
            if i == 0 and "a-direct" in wanted:
                direct = Target(server.url, server.served_model_name, priority=0)
                one("a-direct", interactive=direct, batch="backfill", stack=st)
        if "a" not in wanted:
            break
