"""Shared prompt prefixes in the simulator (issue 36): the engine's prefix cache holds a
prefix's blocks once and skips their prefill, the reserving policies reserve it once per node,
and a workload without prefixes runs exactly as before."""

from __future__ import annotations

import dataclasses

from backfill_analysis.simulate.costmodel import CostModel
from backfill_analysis.simulate.engine import DECODE, PAUSED, Engine, EngineConfig, Sequence
from backfill_analysis.simulate.metrics import PolicyResult
from backfill_analysis.simulate.policies import Frontend, PolicyKnobs, Reserving
from backfill_analysis.simulate.prefix_cache import PrefixHolds, shareable_blocks
from backfill_analysis.simulate.run import RunSpec, simulate
from backfill_analysis.simulate.trace import TraceRequest
from backfill_analysis.simulate.workload import BatchWorkload, batch_items

COST = CostModel(
    "test",
    step_overhead_s=0.01,
    per_prefill_token_s=1e-4,
    per_prefill_attention_s=0.0,
    per_decode_token_s=1e-3,
    per_decode_context_s=0.0,
)
BS = 16
PREFIX_BLOCKS = 8  # a 128-token instruction


def _engine(num_blocks: int = 400) -> Engine:
    return Engine(EngineConfig(num_blocks, BS, COST, max_num_batched_tokens=4096))


def _seq(key: int, document: int, output: int = 40) -> Sequence:
    prompt = PREFIX_BLOCKS * BS + document
    blocks = shareable_blocks(prompt, PREFIX_BLOCKS * BS, BS)
    return Sequence(key, prompt, output, 10, False, prefix="job", prefix_blocks=blocks)


def _own_blocks(seq: Sequence, engine: Engine) -> int:
    """The blocks ``seq``'s context needs less the cached prefix's it uses."""
    length = seq.computed
    if seq.state == DECODE:
        length = seq.entry_length + engine.step_index - seq.entry_step
    return -(-length // BS) - seq.shared


def test_sequences_sharing_a_cached_prefix_hold_its_blocks_once() -> None:
    engine = _engine()
    first = _seq(1, 50)
    engine.add(first)
    report = engine.step(0.0)
    assert report.batch_prefill_tokens == first.prompt_tokens  # cold: computed whole
    assert first.shared == PREFIX_BLOCKS  # its prefix blocks are now the cached copy
    assert engine.prefix_cache.blocks == PREFIX_BLOCKS
    others = [_seq(k, 30 + 7 * k) for k in range(2, 6)]
    for s in others:
        engine.add(s)
    report = engine.step(1.0)
    # The prefill of the cached blocks is skipped: only the documents are computed.
    assert report.batch_prefill_tokens == sum(s.prompt_tokens - PREFIX_BLOCKS * BS for s in others)
    running = [first, *others]
    assert all(s.shared == PREFIX_BLOCKS for s in running)
    own = sum(_own_blocks(s, engine) for s in running)
    assert engine.blocks_in_use() == PREFIX_BLOCKS + own
    # Without sharing every sequence would hold the prefix: N - 1 copies more.
    assert own + len(running) * PREFIX_BLOCKS - engine.blocks_in_use() == 4 * PREFIX_BLOCKS
    # The prefix is held while any user is resident, and freed with the last one.
    for s in running[:-1]:
        engine.abort(s)
    assert engine.prefix_cache.blocks == PREFIX_BLOCKS
    assert engine.blocks_in_use() == PREFIX_BLOCKS + _own_blocks(running[-1], engine)
    engine.abort(running[-1])
    assert engine.blocks_in_use() == 0
    assert engine.prefix_cache.blocks == 0


def test_sequences_started_before_the_prefix_is_computed_hold_their_own_copy() -> None:
    engine = _engine()
    a, b = _seq(1, 50), _seq(2, 60)
    engine.add(a)
    engine.add(b)
    report = engine.step(0.0)  # both prefill side by side: nothing cached yet
    assert report.batch_prefill_tokens == a.prompt_tokens + b.prompt_tokens
    assert (a.shared, b.shared) == (PREFIX_BLOCKS, 0)
    assert engine.blocks_in_use() == -(-a.prompt_tokens // BS) + -(-b.prompt_tokens // BS)


def test_prefix_sharers_run_to_completion_and_free_every_block() -> None:
    engine = _engine()
    seqs = [_seq(k, 20 + 13 * k, output=5 + 9 * k) for k in range(12)]
    now = 0.0
    for i, s in enumerate(seqs):
        engine.add(s)
        for _ in range(i % 3):
            now += max(engine.step(now).seconds, 1e-3)
            for r in engine.sequences():
                assert r.state != PAUSED
            held = sum(_own_blocks(r, engine) for r in engine.sequences())
            assert engine.blocks_in_use() == held + engine.prefix_cache.blocks
    while not engine.idle:
        now += max(engine.step(now).seconds, 1e-3)
    assert all(s.finished for s in seqs)
    assert engine.blocks_in_use() == 0
    assert engine.prefix_cache.blocks == 0


def test_prefix_holds_reserve_once_and_release_with_the_last_holder() -> None:
    holds = PrefixHolds(wait_s=30.0)
    assert holds.share("p", 128, 0.0) == 128  # none held: the first holder
    holds.take(1, "p", 128, 0.0)
    assert holds.tokens == 128
    assert holds.share("p", 128, 1.0) is None  # the group waits for its first token
    assert holds.share("p", 128, 31.0) == 0  # too long: whole prompts
    holds.first_token(1)
    assert holds.share("p", 128, 2.0) == 128  # warm: lean on it
    holds.take(2, "p", 128, 2.0)
    holds.take(3, "p", 128, 2.0)
    assert holds.tokens == 128  # held once
    assert holds.release(1) == 0
    assert holds.release(3) == 0
    assert holds.release(2) == 128
    assert holds.tokens == 0


def _workload(prefix: int, items: int = 60) -> BatchWorkload:
    return BatchWorkload(
        items=items,
        jobs=1,
        prompt_mean=64,
        prompt_min=40,
        prompt_max=100,
        max_output_tokens=32,
        output_exact=True,
        shared_prefix_tokens=prefix,
        first_deadline_s=10_000,
        last_deadline_s=10_000,
    )


def _run(prefix: int, accounting: bool) -> tuple[PolicyResult, int]:
    # 200 blocks of 16 = 3,200 tokens; batch slack 2,400 (a quarter kept for interactive).
    config = EngineConfig(200, BS, COST, max_num_batched_tokens=2048, max_num_seqs=64)
    knobs = PolicyKnobs(reserve_fraction=0.25, max_batch_seqs=64, prefix_accounting=accounting)
    # More items than either setting finishes in the minute: throughput is the rate.
    spec = RunSpec(config, [], batch_items(_workload(prefix, 5000), 0), 60.0, knobs=knobs)
    most = 0

    def watch(policy: Frontend, engine: Engine) -> None:
        nonlocal most
        assert isinstance(policy, Reserving)
        most = max(most, policy.batch_in_flight)
        leases = sum(x.tokens for x in policy.leases.values())
        # The ledger: every lease's own tokens and each held prefix once.
        assert policy.batch_in_use == leases + policy.prefixes.tokens
        # The engine never holds more than the ledger reserved.
        assert engine.blocks_in_use() * BS <= policy.batch_in_use + policy.interactive_in_use
        assert policy.batch_in_use <= 2400

    return simulate(spec, "backfill", watch), most


def test_prefix_accounting_reserves_the_prefix_once_so_more_items_run() -> None:
    without, most_without = _run(960, accounting=False)
    with_, most_with = _run(960, accounting=True)
    # Whole: round_up(960 + ~64 + 32) ~ 1,072 tokens an item, two in 2,400. Once: 960 for the
    # node and ~100 an item.
    assert most_without == 2
    assert most_with >= 4 * most_without
    assert with_.batch_tokens_per_s >= 2 * without.batch_tokens_per_s


def test_without_a_prefix_the_accounting_knob_changes_nothing() -> None:
    trace = [TraceRequest(float(t), 200, 20) for t in range(0, 60, 7)]
    config = EngineConfig(200, BS, COST, max_num_batched_tokens=2048, max_num_seqs=64)
    results = []
    for accounting in (False, True):
        knobs = PolicyKnobs(reserve_fraction=0.25, prefix_accounting=accounting)
        spec = RunSpec(config, trace, batch_items(_workload(0, 200), 0), 60.0, knobs=knobs)
        for policy in ("backfill", "backfill-budget", "backfill-step"):
            r = dataclasses.replace(simulate(spec, policy), wall_s=0.0)
            results.append(r)
    assert results[:3] == results[3:]


def test_a_shared_prefix_only_prepends_the_instruction_to_the_same_documents() -> None:
    plain = batch_items(BatchWorkload(items=300, jobs=3), 7)
    assert all(i.prefix_tokens == 0 for i in plain)
    shared = batch_items(BatchWorkload(items=300, jobs=3, shared_prefix_tokens=1000), 7)
    assert [i.prompt_tokens + 1000 for i in plain] == [i.prompt_tokens for i in shared]
    assert [i.output_tokens for i in plain] == [i.output_tokens for i in shared]
    assert {i.prefix_tokens for i in shared} == {1000}
