"""The protection benchmark's "TTFT split" table: each part's mean from the step scheduler's
histograms, or from vLLM's own where only interactive requests ran on a stock engine."""

from __future__ import annotations

import pytest

from backfill_vllm.metrics import SchedulerMetrics
from bench.protection.split import (
    ENGINE_SPLIT_COUNTERS,
    SCHEDULER_SPLIT_COUNTERS,
    split_table,
    ttft_split,
)
from bench.stack import counters


def test_the_step_schedulers_histograms_give_each_parts_mean() -> None:
    metrics = SchedulerMetrics("test", "0", 10)
    metrics.ttft_split.observe(0.1, 0.0, 0.4)
    metrics.ttft_split.observe(0.3, 0.2, 0.6)
    deltas = counters(metrics.render(), SCHEDULER_SPLIT_COUNTERS)
    got = ttft_split({}, deltas, interactive_only=False, ttfts=[1.0, 2.0])
    assert got["source"] == "backfill_sched"
    assert got["requests"] == 2
    assert got["step_in_flight_mean_s"] == pytest.approx(0.2)
    assert got["queueing_mean_s"] == pytest.approx(0.1)
    assert got["prefill_mean_s"] == pytest.approx(0.5)
    assert got["rest_mean_s"] == pytest.approx(1.5 - 0.8)


def test_alone_on_the_stock_engine_reads_vllms_own_histograms() -> None:
    engine = dict.fromkeys(ENGINE_SPLIT_COUNTERS, 0.0) | {
        "vllm:request_queue_time_seconds_sum": 0.5,
        "vllm:request_queue_time_seconds_count": 5,
        "vllm:request_prefill_time_seconds_sum": 2.0,
        "vllm:request_prefill_time_seconds_count": 5,
    }
    got = ttft_split(engine, {}, interactive_only=True, ttfts=[0.5])
    assert got["source"] == "vllm"
    assert got["step_in_flight_mean_s"] is None
    assert got["queueing_mean_s"] == pytest.approx(0.1)
    assert got["prefill_mean_s"] == pytest.approx(0.4)
    # With batch beside it vLLM's histograms are not interactive's: no split.
    assert ttft_split(engine, {}, interactive_only=False, ttfts=[0.5]) == {}


def test_the_table_shows_alone_beside_a() -> None:
    alone = {
        "scenario": "alone",
        "ttft_split": {
            "source": "vllm",
            "requests": 5,
            "step_in_flight_mean_s": None,
            "queueing_mean_s": 0.1,
            "prefill_mean_s": 0.4,
            "rest_mean_s": 0.05,
            "client_ttft_mean_s": 0.55,
        },
    }
    a = {
        "scenario": "a",
        "ttft_split": {
            "source": "backfill_sched",
            "requests": 5,
            "step_in_flight_mean_s": 0.2,
            "queueing_mean_s": 0.3,
            "prefill_mean_s": 0.5,
            "rest_mean_s": 0.1,
            "client_ttft_mean_s": 1.1,
        },
    }
    text = split_table([alone, a, {"scenario": "batch-straight", "ttft_split": {}}])
    assert text is not None
    lines = text.splitlines()
    assert lines[0].startswith("TTFT split")
    assert "step in flight s" in lines[1]
    assert [line.split()[0] for line in lines[3:]] == ["alone", "a"]
    assert "—" in lines[3]
    assert split_table([{"scenario": "b", "ttft_split": {}}]) is None
