"""One simulated run: a trace of interactive requests and a batch backlog through a policy
into the engine, in simulated time."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backfill_analysis.simulate.engine import Engine, EngineConfig
from backfill_analysis.simulate.metrics import KvSample, PolicyResult, percentile
from backfill_analysis.simulate.policies import POLICIES, Frontend, PolicyKnobs
from backfill_analysis.simulate.trace import TraceRequest
from backfill_analysis.simulate.workload import BatchItem


@dataclass(frozen=True)
class RunSpec:
    """Everything one run needs besides the policy."""

    engine: EngineConfig
    interactive: Sequence[TraceRequest]
    batch: Sequence[BatchItem]
    duration_s: float
    ttft_slo_s: float = 1.0
    knobs: PolicyKnobs = field(default_factory=PolicyKnobs)
    sample_every_s: float = 10.0


Observer = Callable[[Frontend, Engine], None]


def simulate(spec: RunSpec, policy_name: str, observe: Observer | None = None) -> PolicyResult:
    """Run ``policy_name`` on ``spec``; deterministic (no randomness inside). ``observe`` is
    called after every admission round and every step (tests check invariants with it)."""
    started = time.perf_counter()
    try:
        policy_cls = POLICIES[policy_name]
    except KeyError:
        raise ValueError(f"unknown policy {policy_name!r}; one of {', '.join(POLICIES)}") from None
    config = spec.engine
    engine_config = EngineConfig(
        config.num_blocks,
        config.block_size,
        config.cost,
        config.max_num_batched_tokens,
        config.max_num_seqs,
        priority_scheduling=policy_cls.priority_scheduling,
        step_schedule=spec.knobs.step_schedule if policy_cls.shapes_steps else None,
        async_scheduling=config.async_scheduling,
        host_gap_s=config.host_gap_s,
        prefix_caching=config.prefix_caching,
    )
    engine = Engine(engine_config)
    policy = policy_cls(engine, list(spec.batch), spec.knobs)
    arrivals = spec.interactive
    overhead = config.cost.request_overhead_s
    horizon = spec.duration_s
    now = 0.0
    i = 0
    ttfts: list[float] = []
    gaps: list[float] = []
    batch_tokens = 0
    batch_prompt = 0
    interactive_tokens = 0
    steps = 0
    kv_integral = 0.0
    busy = 0.0
    max_blocks = 0
    timeline: list[KvSample] = []
    next_sample = 0.0
    # Under async scheduling the step starting now was scheduled when the one before it
    # started: it takes only what had arrived by then, and its host time was hidden behind
    # that step. A step not scheduled ahead takes what has arrived by now and idles the device
    # for its host time first.
    scheduled_at = now
    in_flight = False
    while now < horizon:
        ahead = config.async_scheduling and in_flight and engine.schedules_ahead(now)
        cutoff = scheduled_at if ahead else now
        while i < len(arrivals) and arrivals[i].arrival_s + overhead <= cutoff:
            policy.on_interactive(arrivals[i], now)
            i += 1
        policy.before_step(now)
        if observe is not None:
            observe(policy, engine)
        if now >= next_sample:
            inter = engine.interactive_blocks_in_use()
            timeline.append(KvSample(now, inter, engine.blocks_in_use() - inter))
            next_sample += spec.sample_every_s
        report = engine.step(now, ahead=ahead, host_gap_s=0.0 if ahead else config.host_gap_s)
        if report.seconds <= 0:
            # Idle: nothing to run until the next arrival (batch waits on policy or is done);
            # no step is in flight, so the next one takes what has arrived by its start.
            nxt = arrivals[i].arrival_s + overhead if i < len(arrivals) else horizon
            # ... or until batch, sitting out right after interactive work, may move again.
            wake = engine.wake_s(now)
            if wake is not None:
                nxt = min(nxt, wake)
            now = max(now, min(nxt, horizon, next_sample))
            scheduled_at = now
            in_flight = False
            continue
        scheduled_at = now
        in_flight = True
        steps += 1
        used = engine.blocks_in_use()
        max_blocks = max(max_blocks, used)
        end = min(now + report.seconds, horizon)
        kv_integral += used * (end - now)
        busy += end - now
        now += report.seconds
        if now <= horizon:
            batch_tokens += report.batch_output_tokens
            batch_prompt += report.batch_prefill_tokens
            interactive_tokens += (
                report.interactive_prefill_tokens + report.interactive_output_tokens
            )
        for seq in report.first_tokens:
            if seq.interactive:
                req = seq.owner
                assert isinstance(req, TraceRequest)
                ttfts.append(seq.first_token_s - req.arrival_s)
        gaps.extend(report.interactive_gaps)
        policy.after_step(report, now)
        if observe is not None:
            observe(policy, engine)
    unserved = len(arrivals) - len(ttfts)
    served_within = sum(1 for t in ttfts if t <= spec.ttft_slo_s)
    all_ttfts = ttfts + [float("inf")] * unserved
    due = [it for it in spec.batch if it.deadline_s <= horizon]
    met = sum(1 for w, t in policy.completed if t <= w.item.deadline_s <= horizon)
    return PolicyResult(
        policy=policy_name,
        duration_s=horizon,
        interactive_requests=len(arrivals),
        ttft_p50_s=percentile(all_ttfts, 50),
        ttft_p99_s=percentile(all_ttfts, 99),
        itl_p50_s=percentile(gaps, 50),
        itl_p99_s=percentile(gaps, 99),
        slo_attainment=served_within / len(arrivals) if arrivals else 1.0,
        batch_output_tokens=batch_tokens,
        batch_tokens_per_s=batch_tokens / horizon,
        batch_prompt_tokens_per_s=batch_prompt / horizon,
        interactive_tokens_per_s=interactive_tokens / horizon,
        batch_items_completed=len(policy.completed),
        deadline_attainment=met / len(due) if due else 1.0,
        items_expired=policy.expired,
        kv_utilisation=kv_integral / (horizon * config.num_blocks),
        preemptions=engine.preemptions + policy.policy_preemptions,
        recomputed_tokens=engine.recomputed_tokens + policy.policy_recomputed,
        max_blocks_in_use=max_blocks,
        steps=steps,
        busy_s=busy,
        wall_s=time.perf_counter() - started,
        kv_timeline=timeline,
        ttfts=all_ttfts,
    )
