"""bench.protection.cpu_share: CPU time per role from two process snapshots (pure), and a live
snapshot."""

from __future__ import annotations

import os
import time

import pytest

from bench.protection.cpu_share import ProcessTime, shares, snapshot


def test_each_process_counts_for_the_nearest_root_above_it_then_by_name() -> None:
    before = {
        10: ProcessTime(1, "vllm", 5.0),
        11: ProcessTime(10, "EngineCore", 100.0),
        20: ProcessTime(1, "backfill", 1.0),
        21: ProcessTime(20, "celery", 2.0),
        30: ProcessTime(1, "postgres", 3.0),
        31: ProcessTime(30, "postgres", 0.5),
        40: ProcessTime(1, "redis-server", 0.1),
        50: ProcessTime(1, "python", 7.0),
    }
    after = {
        10: ProcessTime(1, "vllm", 6.0),  # +1
        11: ProcessTime(10, "EngineCore", 110.0),  # +10
        20: ProcessTime(1, "backfill", 2.0),  # +1
        21: ProcessTime(20, "celery", 3.0),  # +1, under its root
        22: ProcessTime(20, "celery", 0.5),  # new in the window: counted from 0
        30: ProcessTime(1, "postgres", 4.0),  # +1
        31: ProcessTime(30, "postgres", 1.5),  # +1
        40: ProcessTime(1, "redis-server", 0.6),  # +0.5
        50: ProcessTime(1, "python", 9.0),  # +2: the client
        51: ProcessTime(50, "sh", 1.0),  # the client's child
        60: ProcessTime(1, "other", 2.0),
    }
    roots = {"engine_api": [10], "engine_core": [11], "backfill": [20]}
    got = shares(before, after, 10.0, roots, client=50)
    assert got == {
        "backfill": pytest.approx(0.25),
        "client": pytest.approx(0.3),
        "engine_api": pytest.approx(0.1),
        "engine_core": pytest.approx(1.0),
        "other": pytest.approx(0.2),
        "postgres": pytest.approx(0.2),
        "redis": pytest.approx(0.05),
    }
    assert shares(before, after, 0.0, roots, client=50) == {}


def test_a_reused_pid_of_another_program_counts_from_zero() -> None:
    before = {7: ProcessTime(1, "old", 50.0)}
    after = {7: ProcessTime(1, "new", 2.0)}
    assert shares(before, after, 1.0, {}, client=0) == {"other": 2.0}


def test_a_live_snapshot_sees_this_process_spend_cpu() -> None:
    first = snapshot()
    assert os.getpid() in first
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    second = snapshot()
    got = shares(first, second, 1.0, {}, client=os.getpid())
    assert got["client"] >= 0.15
