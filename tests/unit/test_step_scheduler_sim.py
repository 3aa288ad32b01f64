"""The simulator's ``backfill-step`` policy: Backfill's engine scheduler class modelled in the
engine's step loop. Batch decoders pause (resident, no tokens, nothing recomputed) while
interactive work waits or prefills; the starvation bound and the ride-along share let some
through; batch prefill per step is capped in step time; interactive work short of blocks or of
a sequence slot takes them from batch."""

from __future__ import annotations

import dataclasses
import random

import pytest

from backfill.work_budget import WorkBudgetPolicy
from backfill_analysis.simulate.costmodel import CostModel, StepWork
from backfill_analysis.simulate.engine import (
    DECODE,
    DONE,
    PAUSED,
    Engine,
    EngineConfig,
    Sequence,
    StepReport,
)
from backfill_analysis.simulate.policies import BackfillStep, BackfillWorkBudget, PolicyKnobs
from backfill_analysis.simulate.run import simulate
from backfill_analysis.simulate.stepsched import StepSchedule, chunk_tokens, prefill_seconds
from backfill_analysis.simulate.trace import TraceRequest
from backfill_analysis.simulate.workload import BatchItem, BatchWorkload, batch_items
from backfill_vllm.policy import idle_ready
from tests.unit.test_simulator import COST, _blocks, _check_pool, _run_to_completion, _spec

BATCH, INTERACTIVE = 10, 0


def _engine(
    schedule: StepSchedule | None = None,
    *,
    blocks: int = 1000,
    seqs: int = 64,
    tokens: int = 256,
    cost: CostModel = COST,
) -> Engine:
    return Engine(
        EngineConfig(
            num_blocks=blocks,
            block_size=16,
            cost=cost,
            max_num_batched_tokens=tokens,
            max_num_seqs=seqs,
            step_schedule=schedule,
        )
    )


def _decoding_batch(
    engine: Engine, n: int, prompt: int = 40, output: int = 500
) -> tuple[list[Sequence], float]:
    """``n`` batch sequences, stepped until all decode; returns them and the clock."""
    seqs = [Sequence(i, prompt, output, BATCH, interactive=False) for i in range(n)]
    for s in seqs:
        engine.add(s)
    now = 0.0
    while any(s.first_token_s < 0 for s in seqs):
        now += engine.step(now).seconds
    return seqs, now


def _tokens(engine: Engine, seq: Sequence) -> int:
    """Output tokens ``seq`` has now (exact also inside the decoding aggregate)."""
    if seq.state != DECODE:
        return seq.generated
    return seq.generated + engine.step_index - seq.entry_step


def _run_until_first_token(
    engine: Engine, seq: Sequence, now: float
) -> tuple[list[StepReport], float]:
    reports = []
    while seq.first_token_s < 0:
        report = engine.step(now)
        _check_pool(engine)
        reports.append(report)
        now += report.seconds
    return reports, now


def test_batch_decoders_pause_while_interactive_prefills_and_lose_nothing() -> None:
    engine = _engine(StepSchedule(starvation_s=0))
    batch, now = _decoding_batch(engine, 8)
    before = [
        (_tokens(engine, s), s.entry_length + engine.step_index - s.entry_step) for s in batch
    ]
    blocks = [_blocks(length, 16) for _, length in before]
    # A prompt of 2,000 tokens takes eight steps of 256.
    interactive = Sequence(100, 2000, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    reports, now = _run_until_first_token(engine, interactive, now)
    assert len(reports) == 8
    assert all(r.batch_output_tokens == 0 and r.batch_prefill_tokens == 0 for r in reports)
    assert all(r.batch_paused == 8 for r in reports)
    # Resident with their blocks and computed tokens; nothing aborted or recomputed.
    assert all(s.state == PAUSED for s in batch)
    assert [(s.generated, s.computed) for s in batch] == before
    assert [s.blocks for s in batch] == blocks
    assert engine.preemptions == 0
    assert engine.recomputed_tokens == 0
    # Once the interactive request has its first token, batch carries on where it was.
    report = engine.step(now)
    assert report.batch_output_tokens == 8
    assert all(_tokens(engine, s) == t + 1 for s, (t, _) in zip(batch, before, strict=True))


def test_the_stock_scheduler_lets_batch_decode_through_an_interactive_prefill() -> None:
    # The peer: vLLM's own scheduler gives every decoder its token in every step, so the
    # interactive prefill shares its steps with batch (what the pause removes).
    engine = _engine(None)
    _, now = _decoding_batch(engine, 8)
    interactive = Sequence(100, 2000, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    reports, _ = _run_until_first_token(engine, interactive, now)
    assert all(r.batch_output_tokens == 8 for r in reports)


def test_waiting_batch_is_not_admitted_while_interactive_is_pending() -> None:
    engine = _engine(StepSchedule(starvation_s=0))
    interactive = Sequence(100, 2000, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    engine.add(Sequence(1, 40, 5, BATCH, interactive=False))
    reports, now = _run_until_first_token(engine, interactive, 0.0)
    assert sum(r.batch_prefill_tokens for r in reports) == 0
    assert engine.step(now).batch_prefill_tokens == 40


@pytest.mark.parametrize("bound", [3, 5])
def test_a_paused_batch_sequence_progresses_within_the_step_bound(bound: int) -> None:
    engine = _engine(StepSchedule(starvation_steps=bound, starvation_s=0), tokens=64)
    batch, now = _decoding_batch(engine, 4)
    last = {s.key: engine.step_index - 1 for s in batch}
    gaps: list[int] = []
    steps = 0
    interactive = Sequence(100, 64 * 30, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    while interactive.first_token_s < 0:
        steps += 1
        step = engine.step_index
        had = {s.key: _tokens(engine, s) for s in batch}
        now += engine.step(now).seconds
        _check_pool(engine)
        for s in batch:
            if _tokens(engine, s) > had[s.key]:
                gaps.append(step - last[s.key])
                last[s.key] = step
    # About thirty steps of interactive prefill: every batch sequence got tokens, none waited
    # more than the bound, and most steps carried no batch at all.
    assert steps >= 30
    assert all(engine.step_index - 1 - last[s.key] < bound for s in batch)
    assert gaps
    assert max(gaps) == bound
    assert len(gaps) <= 4 * (steps // bound + 1)


def test_a_paused_batch_sequence_progresses_within_the_time_bound() -> None:
    bound_s = 0.2
    engine = _engine(StepSchedule(starvation_s=bound_s), tokens=64)
    batch, now = _decoding_batch(engine, 4)
    last = {s.key: now for s in batch}
    steps: list[float] = []
    worst = 0.0
    interactive = Sequence(100, 64 * 60, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    while interactive.first_token_s < 0:
        had = {s.key: _tokens(engine, s) for s in batch}
        report = engine.step(now)
        steps.append(report.seconds)
        now += report.seconds
        for s in batch:
            if _tokens(engine, s) > had[s.key]:
                worst = max(worst, now - last[s.key])
                last[s.key] = now
    assert worst > 0, "batch never progressed"
    # Within the bound, give or take how much a step's time differs from the one before it
    # (the scheduler prices the coming step as the last one).
    assert len(steps) >= 60
    spread = max(steps) - min(steps)
    assert worst <= bound_s + 2 * spread + 1e-9
    assert worst > bound_s - max(steps)
    assert all(now - t <= bound_s + 2 * spread + 1e-9 for t in last.values())


def test_without_a_starvation_bound_batch_waits_out_the_whole_prefill() -> None:
    engine = _engine(StepSchedule(starvation_steps=0, starvation_s=0), tokens=64)
    batch, now = _decoding_batch(engine, 4)
    had = [_tokens(engine, s) for s in batch]
    interactive = Sequence(100, 64 * 30, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    reports, _ = _run_until_first_token(engine, interactive, now)
    assert len(reports) == 30
    assert [s.generated for s in batch] == had


def test_a_paused_batch_prefill_gets_a_chunk_at_its_bound() -> None:
    engine = _engine(
        StepSchedule(chunk_target_s=0.005, starvation_steps=4, starvation_s=0), tokens=128
    )
    long_batch = Sequence(1, 1000, 5, BATCH, interactive=False)
    engine.add(long_batch)
    now = engine.step(0.0).seconds  # batch prefill under way
    computed = [long_batch.computed]
    interactive = Sequence(100, 128 * 20, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    while interactive.first_token_s < 0:
        now += engine.step(now).seconds
        computed.append(long_batch.computed)
    moved = [i for i in range(1, len(computed)) if computed[i] > computed[i - 1]]
    assert moved, "the paused prefill never moved"
    assert all(b - a <= 4 for a, b in zip([0, *moved], moved, strict=False))
    # Each of its chunks within the chunk target: 50 tokens at 1e-4 s each.
    assert all(computed[i] - computed[i - 1] <= 50 for i in moved)


def test_batch_prefill_per_step_stays_within_the_chunk_target() -> None:
    target = 0.01  # 100 tokens at COST's 1e-4 s per prompt token
    engine = _engine(StepSchedule(chunk_target_s=target), tokens=2048)
    stock = _engine(None, tokens=2048)
    for e in (engine, stock):
        for i in range(6):
            e.add(Sequence(i, 700, 20, BATCH, interactive=False))
    capped: list[int] = []
    uncapped: list[int] = []
    for e, out in ((engine, capped), (stock, uncapped)):
        now = 0.0
        while not e.idle:
            report = e.step(now)
            _check_pool(e)
            out.append(report.batch_prefill_tokens)
            now += report.seconds
    assert max(capped) == 100
    assert sum(capped) == sum(uncapped) == 6 * 700
    assert max(uncapped) > 1000


def test_an_arriving_interactive_request_waits_at_most_one_short_step() -> None:
    target = 0.01
    engine = _engine(StepSchedule(chunk_target_s=target), tokens=2048)
    for i in range(6):
        engine.add(Sequence(i, 1500, 20, BATCH, interactive=False))
    now = 0.0
    for _ in range(5):  # mid batch prefill
        now += engine.step(now).seconds
    in_flight = engine.step(now)
    arrival = now + in_flight.seconds / 2
    now += in_flight.seconds
    interactive = Sequence(100, 200, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    _run_until_first_token(engine, interactive, now)
    alone = COST.step_seconds(StepWork(prefill_tokens=200))
    # The step it arrived in is short (the overhead and at most `target` of batch prefill;
    # nothing decodes yet), then its own prefill step runs with batch paused, as alone.
    assert in_flight.batch_prefill_tokens == 100
    assert in_flight.seconds <= COST.step_overhead_s + target + 1e-9
    assert interactive.first_token_s - arrival == pytest.approx(in_flight.seconds / 2 + alone)


def test_interactive_short_of_blocks_takes_them_from_batch_first() -> None:
    # 40 blocks of 16 tokens; batch fills them, then an interactive request needs 20.
    engine = _engine(StepSchedule(starvation_s=0), blocks=40, tokens=512)
    _, now = _decoding_batch(engine, 6, prompt=90, output=400)
    assert engine.free_blocks < 20
    interactive = Sequence(100, 320, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    report = engine.step(now)
    assert interactive.first_token_s > 0
    assert report.preempted
    assert all(not s.interactive for s in report.preempted)
    # Preempted batch waits to recompute; the rest stays paused or decoding.
    assert engine.recomputed_tokens > 0
    _check_pool(engine)


def test_interactive_takes_a_sequence_slot_from_batch() -> None:
    engine = _engine(StepSchedule(starvation_s=0), seqs=4)
    _, now = _decoding_batch(engine, 4)
    interactive = Sequence(100, 100, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    report = engine.step(now)
    assert interactive.first_token_s > 0
    assert len(report.preempted) == 1
    assert not report.preempted[0].interactive
    assert engine.running == 4


def test_ride_along_share_bounds_how_much_batch_lengthens_an_interactive_step() -> None:
    share = 0.5
    engine = _engine(StepSchedule(ride_along_share=share, starvation_s=0), tokens=256)
    _, now = _decoding_batch(engine, 40)
    interactive = Sequence(100, 100, 5, INTERACTIVE, interactive=True)
    engine.add(interactive)
    reports, _ = _run_until_first_token(engine, interactive, now)
    # Without batch the step is 0.01 s + 100 tokens x 1e-4 s = 0.02 s; each rider adds 1e-3 s:
    # ten of the forty paused decoders ride along, the others wait.
    alone = COST.step_seconds(StepWork(prefill_tokens=100))
    assert len(reports) == 1
    assert reports[0].batch_output_tokens == 10
    assert reports[0].batch_paused == 30
    assert reports[0].seconds == pytest.approx((1 + share) * alone)


@pytest.mark.parametrize("seed", range(30))
def test_pool_accounting_survives_pauses_riders_and_preemption(seed: int) -> None:
    rng = random.Random(seed)
    schedule = StepSchedule(
        ride_along_share=rng.choice([0.0, 0.3, 2.0]),
        chunk_target_s=rng.choice([0.002, 0.01, 0.1]),
        starvation_steps=rng.choice([0, 2, 7]),
        starvation_s=rng.choice([0.0, 0.05, 1.0]),
    )
    bs = rng.choice([1, 4, 16])
    engine = Engine(
        EngineConfig(
            num_blocks=rng.randint(30, 80) * 16 // bs + 4,
            block_size=bs,
            cost=COST,
            max_num_batched_tokens=rng.choice([64, 256, 2048]),
            max_num_seqs=rng.choice([4, 16, 64]),
            step_schedule=schedule,
        )
    )
    # The step scheduler tells the classes apart by priority, as the real one does.
    seqs = [
        Sequence(i, rng.randint(1, 300), rng.randint(1, 150), prio, interactive=prio == 0)
        for i, prio in enumerate(rng.choice([0, 10, 10]) for _ in range(50))
    ]
    _run_to_completion(engine, seqs, rng)
    assert engine.paused == 0


def _budget_frontend(cls: type[BackfillWorkBudget]) -> BackfillWorkBudget:
    """A frontend whose work budget sees an interactive request that has waited 1 s of a
    0.1 s TTFT target while a batch prefill is under way, and has just stepped."""
    engine = _engine(StepSchedule() if cls.shapes_steps else None, tokens=64)
    item = BatchItem(
        key=1, job=0, prompt_tokens=1000, max_output_tokens=20, output_tokens=20, deadline_s=3600.0
    )
    knobs = PolicyKnobs(work_budget=WorkBudgetPolicy(ttft_target_s=0.1))
    frontend = cls(engine, [item], knobs)
    frontend.before_step(0.0)
    frontend.after_step(engine.step(0.0), 0.1)
    assert frontend.batch_in_flight == 1  # mid prefill
    frontend.on_interactive(TraceRequest(0.0, 500, 5), 0.1)
    frontend.before_step(1.0)  # the controller steps
    return frontend


def test_the_work_budget_stops_preempting_when_the_engine_pauses() -> None:
    stock = _budget_frontend(BackfillWorkBudget)
    step = _budget_frontend(BackfillStep)
    # In front of vLLM's own scheduler the budget aborts the batch prefill for the request;
    # in front of Backfill's the engine pauses it instead, and nothing is recomputed.
    assert stock.budget_preemptions == 1
    assert stock.batch_in_flight == 0
    assert step.budget_preemptions == 0
    assert step.batch_in_flight == 1
    assert step.policy_recomputed == 0
    # The budget still paces admission: it shrank and holds new batch prefills.
    assert step.budget.hold


def test_backfill_step_protects_ttft_better_than_the_work_budget_with_as_much_batch() -> None:
    # A backlog the run cannot finish, so batch throughput is the policy's, not the backlog's.
    items = batch_items(
        BatchWorkload(
            items=2000,
            jobs=2,
            prompt_mean=300,
            prompt_min=32,
            prompt_max=400,
            max_output_tokens=64,
            first_deadline_s=60,
            last_deadline_s=200,
        ),
        seed=3,
    )
    spec = _spec(batch=items)
    step = simulate(spec, "backfill-step")
    budget = simulate(spec, "backfill-budget")
    priority = simulate(spec, "priority")
    assert step.ttft_p50_s < budget.ttft_p50_s
    assert step.ttft_p50_s < priority.ttft_p50_s
    assert step.ttft_p99_s <= budget.ttft_p99_s
    assert step.batch_tokens_per_s >= 0.8 * budget.batch_tokens_per_s


def test_chunk_tokens_is_the_largest_chunk_within_the_time() -> None:
    cost = CostModel(
        "q",
        step_overhead_s=0.01,
        per_prefill_token_s=1e-4,
        per_prefill_attention_s=1e-7,
        per_decode_token_s=1e-3,
        per_decode_context_s=0.0,
    )
    for start in (0, 100, 5000):
        for seconds in (1e-5, 0.003, 0.05, 1.0):
            n = chunk_tokens(cost, start, seconds, 10**6)
            assert prefill_seconds(cost, start, n) <= seconds
            assert prefill_seconds(cost, start, n + 1) > seconds
    assert chunk_tokens(cost, 0, 1.0, 7) == 7
    assert chunk_tokens(cost, 0, 0.0, 7) == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"ride_along_share": -0.1},
        {"ride_along_share": float("nan")},
        {"chunk_target_s": 0},
        {"starvation_steps": -1},
        {"starvation_s": -1.0},
        {"starvation_s": float("inf")},
    ],
)
def test_step_schedule_refuses_bad_settings(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        StepSchedule(**bad)  # type: ignore[arg-type]


def test_the_step_scheduler_needs_priority_scheduling() -> None:
    with pytest.raises(ValueError, match="priority"):
        EngineConfig(
            num_blocks=10,
            block_size=16,
            cost=COST,
            priority_scheduling=False,
            step_schedule=StepSchedule(),
        )


# -- the whole-step bound and async scheduling ---------------------------------------------


def test_within_the_likely_window_batch_decoders_take_turns_within_the_step_target() -> None:
    # 1 ms a decoder, a 10 ms target: 10 of 30 batch decoders a step, each in turn, beside an
    # interactive decoder; with the bound off all 30 decode in every step.
    bounded = StepSchedule(chunk_target_s=0.01, interactive_likely_s=2.0, starvation_s=0)
    for schedule, per_step in ((bounded, 10), (StepSchedule(starvation_s=0), 30)):
        engine = _engine(schedule)
        batch, now = _decoding_batch(engine, 30, output=400)
        inter = Sequence(99, 16, 200, INTERACTIVE, interactive=True)
        engine.add(inter)
        _, now = _run_until_first_token(engine, inter, now)
        before = {s.key: _tokens(engine, s) for s in batch}
        for _ in range(6):
            report = engine.step(now)
            _check_pool(engine)
            now += report.seconds
            assert report.batch_output_tokens == per_step
            assert report.interactive_output_tokens == 1
        moved = [_tokens(engine, s) - before[s.key] for s in batch]
        assert all(m >= 1 for m in moved), moved  # in turns: everyone moved in 6 steps
        assert sum(moved) == 6 * per_step


def test_under_async_scheduling_the_step_target_is_halved() -> None:
    schedule = StepSchedule(chunk_target_s=0.01, interactive_likely_s=2.0, starvation_s=0)
    engine = Engine(
        EngineConfig(
            num_blocks=1000,
            block_size=16,
            cost=COST,
            max_num_batched_tokens=256,
            max_num_seqs=64,
            step_schedule=schedule,
            async_scheduling=True,
        )
    )
    _decoding_batch(engine, 30, output=400)
    inter = Sequence(99, 16, 200, INTERACTIVE, interactive=True)
    engine.add(inter)
    _, now = _run_until_first_token(engine, inter, 1.0)
    # A step scheduled ahead of the one in flight: an arrival would wait for both.
    report = engine.step(now, ahead=True)
    assert report.batch_output_tokens == 5
    # One scheduled with none in flight gets the whole target.
    assert engine.step(now + report.seconds).batch_output_tokens == 10


def _busy_backlog() -> list[BatchItem]:
    """A batch backlog that keeps every step of the test spec's engine busy."""
    return batch_items(
        BatchWorkload(
            items=3000,
            jobs=1,
            prompt_mean=100,
            prompt_min=32,
            prompt_max=200,
            max_output_tokens=400,
            first_deadline_s=10_000,
            last_deadline_s=10_000,
        ),
        seed=3,
    )


def test_under_async_scheduling_an_arrival_waits_for_the_step_in_flight_and_the_next() -> None:
    # The same lone arrivals beside a batch backlog that keeps every step busy: with async
    # scheduling each first token comes about one step later (the step already scheduled when
    # it arrived); a step here is at least the 10 ms overhead.
    base = _spec()
    items = _busy_backlog()
    ttft = {}
    for flag in (False, True):
        spec = dataclasses.replace(
            base,
            batch=items,
            # Room for everyone: an arrival is admitted in the first step it can be.
            engine=dataclasses.replace(base.engine, num_blocks=4000, async_scheduling=flag),
            knobs=dataclasses.replace(base.knobs, batch_concurrency=8),
        )
        ttft[flag] = simulate(spec, "priority").ttft_p50_s
    assert ttft[True] >= ttft[False] + COST.step_overhead_s, ttft


def test_batch_only_steps_held_back_while_interactive_is_likely_spare_arrivals_a_step() -> None:
    # Async scheduling, lone arrivals every 2 s within a 5 s likely window, a batch backlog
    # that keeps every step busy: scheduled ahead, an arrival waits for the step in flight and
    # the one queued behind it; held back (the default), for the step in flight alone.
    base = _spec()
    items = _busy_backlog()
    gap = 0.002
    results = {}
    for ahead in (True, False):
        spec = dataclasses.replace(
            base,
            batch=items,
            engine=dataclasses.replace(
                base.engine, num_blocks=4000, async_scheduling=True, host_gap_s=gap
            ),
            knobs=dataclasses.replace(
                base.knobs,
                batch_concurrency=8,
                step_schedule=StepSchedule(
                    chunk_target_s=0.01, interactive_likely_s=5.0, ahead_while_likely=ahead
                ),
            ),
        )
        results[ahead] = simulate(spec, "backfill-step")
    ahead, held = results[True], results[False]
    assert held.ttft_p50_s <= ahead.ttft_p50_s - COST.step_overhead_s / 2, (held, ahead)
    # The host gap is paid, but a step not scheduled ahead carries the whole step target
    # (one scheduled ahead, half): batch loses little or gains.
    assert held.batch_tokens_per_s > 0.9 * ahead.batch_tokens_per_s, (held, ahead)


# -- idle-ready: the engine class's rule, run by the simulated engine ------------------------


def _idle(window: float = 1.0, **changes: float) -> StepSchedule:
    return StepSchedule(
        idle_ready_s=window,
        idle_rule=idle_ready,
        starvation_s=0,
        **changes,  # type: ignore[arg-type]
    )


def test_idle_ready_needs_the_engine_classes_own_rule() -> None:
    with pytest.raises(ValueError, match=r"idle_rule=backfill_vllm\.policy\.idle_ready"):
        StepSchedule(idle_ready_s=1.0)
    with pytest.raises(ValueError, match="idle_ready_s"):
        StepSchedule(idle_ready_s=-1.0, idle_rule=idle_ready)
    assert StepSchedule(idle_ready_s=1.0, idle_rule=idle_ready).idle_ready_s == 1.0


def test_batch_sits_out_beside_interactive_work_and_for_the_window_after_it() -> None:
    engine = _engine(_idle(1.0))
    # The window counts from the start too: batch sits out its first second.
    batch = [Sequence(i, 40, 2000, BATCH, interactive=False) for i in range(8)]
    for s in batch:
        engine.add(s)
    assert engine.step(0.0).seconds == 0
    assert engine.wake_s(0.0) == pytest.approx(1.0)
    now = 1.0
    while any(s.first_token_s < 0 for s in batch):
        now += engine.step(now).seconds
    inter = Sequence(99, 16, 5, INTERACTIVE, interactive=True)
    engine.add(inter)
    # Its prefill (holding, as before) and its decodes (idle-ready): no batch token.
    started = now
    while inter.state != DONE:
        report = engine.step(now)
        _check_pool(engine)
        assert report.batch_output_tokens == 0
        assert report.batch_paused == 8
        now += report.seconds
    # Then the engine idles, ready, until the window's end (counted from the last step
    # interactive work was in), and batch carries on there where it was.
    report = engine.step(now)
    assert report.seconds == 0
    wake = engine.wake_s(now)
    assert wake is not None
    assert started < wake - 1.0 < now
    assert engine.step(wake).batch_output_tokens == 8
    assert engine.wake_s(wake) is None
    assert all(s.state == DECODE for s in batch)


def test_the_simulated_engine_runs_the_rule_it_is_handed() -> None:
    calls: list[tuple[float, float]] = []

    def never(window_s: float, quiet_s: float) -> bool:
        calls.append((window_s, quiet_s))
        return False

    engine = _engine(StepSchedule(idle_ready_s=1.0, idle_rule=never, starvation_s=0))
    _, now = _decoding_batch(engine, 8, output=2000)
    inter = Sequence(99, 16, 5, INTERACTIVE, interactive=True)
    engine.add(inter)
    _, now = _run_until_first_token(engine, inter, now)
    report = engine.step(now)  # it decodes: not holding, the rule decides (no: batch moves)
    assert report.batch_output_tokens == 8
    assert calls[-1] == (1.0, 0.0)  # interactive work in the engine: quiet 0


def test_past_the_window_the_lift_runs_batch_prefill_in_long_steps() -> None:
    schedule = _idle(1.0, chunk_target_s=0.002, lift_cap_after_s=1.0, lifted_step_target_s=0.02)
    engine = _engine(schedule, tokens=2048)
    inter = Sequence(99, 16, 2, INTERACTIVE, interactive=True)
    engine.add(inter)
    now = 0.0
    while inter.state != DONE:
        now += engine.step(now).seconds
    engine.add(Sequence(1, 1000, 10, BATCH, interactive=False))
    assert engine.step(now).seconds == 0  # within the window: idle-ready
    # Past it, 0.02 s of prefill a step (200 tokens at 0.1 ms), not the 2 ms chunk (20).
    report = engine.step(now + 1.0)
    assert report.batch_prefill_tokens == 200


def test_idle_ready_spares_the_rest_of_a_burst_the_step_in_flight() -> None:
    # Async scheduling, ten bursts of four alike requests 0.5 s apart, a batch backlog that
    # keeps every step busy. Alone, each finds the engine idle. With batch sitting out for 2 s
    # after interactive work, the three after each burst's first do too: interactive alone's
    # TTFT to the microsecond; under the whole-step bound alone they wait for a step in flight.
    # Batch still runs between the bursts.
    base = _spec()
    trace = [
        TraceRequest(20.0 * burst + 0.5 * k + 1.0, 200, 5) for burst in range(10) for k in range(4)
    ]
    engine = dataclasses.replace(base.engine, num_blocks=4000, async_scheduling=True)
    base = dataclasses.replace(base, interactive=trace, engine=engine, duration_s=200.0)
    alone = simulate(dataclasses.replace(base, batch=[]), "priority")
    ttft = alone.ttfts[0]
    assert alone.ttfts == pytest.approx([ttft] * 40, abs=1e-9)
    results = {}
    bound = StepSchedule(chunk_target_s=0.01, interactive_likely_s=2.0)
    for name, schedule in (("bound", bound), ("idle", _idle(2.0))):
        spec = dataclasses.replace(
            base,
            batch=_busy_backlog(),
            knobs=dataclasses.replace(base.knobs, batch_concurrency=8, step_schedule=schedule),
        )
        results[name] = simulate(spec, "backfill-step")
    idle = sorted(results["idle"].ttfts)
    assert idle[:30] == pytest.approx([ttft] * 30, abs=1e-6), idle
    assert results["idle"].ttft_p50_s == pytest.approx(ttft, abs=1e-6)
    assert results["bound"].ttft_p50_s > ttft + COST.step_overhead_s / 2
    assert results["idle"].batch_tokens_per_s > 0.5 * results["bound"].batch_tokens_per_s
