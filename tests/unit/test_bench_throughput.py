"""bench.throughput's summary: the step-scheduler side's ratio to Backfill on the stock engine."""

from __future__ import annotations

import pytest

from bench.throughput.compare import _rows, summarise
from bench.throughput.workload import SIDES, STEP_SIDE, SideRun, Workload


def _run(side: str, round_no: int, seconds: float) -> SideRun:
    return SideRun(side, "smollm2", round_no, 10, seconds, 640, 17_000, extra={"cpu_s_engine": 5.0})


def test_step_side_ratio_is_best_against_best_of_backfill_on_the_stock_engine() -> None:
    w = Workload("smollm2", 10, 1700, 64, 2, (32,), 10, 2, 0.9)
    runs = [
        _run("backfill", 0, 10.0),
        _run("backfill", 1, 8.0),  # best: 80 tok/s
        _run(STEP_SIDE, 0, 10.0),  # best: 64 tok/s
        _run(STEP_SIDE, 1, 12.0),
        _run("run-batch", 0, 8.0),
        _run("run-batch", 1, 9.0),
        _run("direct", 0, 9.0),
        _run("direct", 1, 9.0),
    ]
    res = summarise(w, runs, {32: 1.0}, 32, (*SIDES, STEP_SIDE))
    assert res["step_scheduler"]["ratio_best"] == 0.8
    # medians: (64 + 53.3) / 2 against (64 + 80) / 2
    assert res["step_scheduler"]["ratio_median"] == pytest.approx((64 + 640 / 12) / 2 / 72)
    labels = [row[1] for row in _rows([res])]
    assert STEP_SIDE in labels
    assert "step scheduler / stock (Backfill)" in labels


def test_without_the_step_side_there_is_no_step_ratio() -> None:
    w = Workload("tiny", 10, 60, 32, 1, (32,), 10, 1, 0.75)
    runs = [_run("backfill", 0, 1.0), _run("run-batch", 0, 1.0), _run("direct", 0, 1.0)]
    res = summarise(w, runs, {32: 1.0}, 32)
    assert res["step_scheduler"] == {}
    assert STEP_SIDE not in [row[1] for row in _rows([res])]
