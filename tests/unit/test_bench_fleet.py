"""The pure parts of ``bench.fleet``: the simulated node's token schedule and the statistics."""

from __future__ import annotations

import math

import pytest

from backfill_analysis.simulate.costmodel import CostModel
from bench.fleet.model import NodeModel, Timeline, h100_node
from bench.fleet.point import CALLS, Point
from bench.fleet.report import report
from bench.fleet.stats import Histogram, cpu_delta, merged

# One step: 10 ms + 1 ms per prefill token / 1 ms per decoding sequence (easy arithmetic).
SIMPLE = NodeModel(CostModel("simple", 0.010, 0.001, 0.0, 0.001, 0.0), max_batched_tokens=100)


def test_settles_come_every_settle_step_of_output_and_none_past_the_end() -> None:
    tl = Timeline(first_token_at=1.0, token_s=0.02, output_tokens=100, settle_every_tokens=32)
    assert [g for _, g in tl.settles()] == [32, 64, 96]
    assert tl.settles()[0][0] == pytest.approx(1.0 + 31 * 0.02)
    assert tl.done_at == pytest.approx(1.0 + 99 * 0.02)
    assert all(t <= tl.done_at for t, _ in tl.settles())


def test_an_output_of_exactly_the_settle_step_settles_at_its_last_token() -> None:
    tl = Timeline(0.0, 0.01, 64, 32)
    assert tl.settles()[-1] == (pytest.approx(tl.done_at), 64)


def test_prompts_are_prefilled_in_chunks_in_order() -> None:
    # Prompts of 60, 60, 30 in chunks of 100: [60+40] [20+30]; each chunk step beside 2
    # decoding sequences costs 10 ms + 1 ms per prompt token + 2 ms.
    tls = SIMPLE.start(0.0, [60, 60, 30], [10, 10, 10], decoding=2, settle_every_tokens=32)
    first_step = 0.010 + 0.100 + 0.002
    second_step = 0.010 + 0.050 + 0.002
    assert tls[0].first_token_at == pytest.approx(first_step)
    assert tls[1].first_token_at == pytest.approx(first_step + second_step)
    assert tls[2].first_token_at == pytest.approx(first_step + second_step)
    # They decode at the step time of the batch they join: 2 + 3 sequences.
    assert all(t.token_s == pytest.approx(0.010 + 0.005) for t in tls)


def test_a_fuller_node_makes_each_token_slower_but_more_tokens_in_all() -> None:
    node = h100_node()
    step_64, step_128 = node.decode_step_s(64, 1150), node.decode_step_s(128, 1150)
    assert step_128 > step_64
    assert 128 / step_128 > 64 / step_64
    # The roofline H100 with Llama-3.1-8B makes thousands of tokens a second at 128 sequences.
    assert 3_000 < 128 / step_128 < 20_000


def test_start_refuses_mismatched_lengths_and_answers_nothing_for_nothing() -> None:
    with pytest.raises(ValueError, match="one output length"):
        SIMPLE.start(0.0, [1, 2], [1], 0, 32)
    assert SIMPLE.start(0.0, [], [], 0, 32) == []


def test_histogram_percentiles_are_within_a_bucket_of_the_truth() -> None:
    h = Histogram()
    for ms in range(1, 1001):
        h.add(ms / 1000)
    assert h.total == 1000
    assert h.percentile(50) == pytest.approx(0.500, rel=0.021)
    assert h.percentile(99) == pytest.approx(0.990, rel=0.021)
    assert h.percentile(100) >= 1.0
    assert math.isnan(Histogram().percentile(50))


def test_histograms_merge_across_processes_and_survive_json() -> None:
    a, b = Histogram(), Histogram()
    for _ in range(99):
        a.add(0.001)
    b.add(1.0)
    both = merged([{"claim": Histogram.from_json(a.to_json())}, {"claim": b}])["claim"]
    assert both.total == 100
    assert both.percentile(50) == pytest.approx(0.001, rel=0.021)
    assert both.percentile(100) == pytest.approx(1.0, rel=0.021)


def test_cpu_delta_counts_new_processes_from_zero_and_skips_gone_ones() -> None:
    assert cpu_delta({1: 10.0, 2: 5.0}, {1: 12.5, 3: 1.0}) == pytest.approx(3.5)


def test_the_report_has_a_column_for_every_call_it_counts() -> None:
    point = Point(10, "backfill", 60.0, 1234.0, 100, 10, 0, {}, 0.5, 0.1, 0.2, 1.5)
    text = report([point])  # raised when CALLS gained a call the header did not name
    calls_table = text.split("calls per second\n", 1)[1].split("\n\n", 1)[0]
    rates = [h for h in calls_table.splitlines()[0].split() if h.endswith("/s")]
    assert len(rates) == len(CALLS)
