"""SharedClock: the reference clock read here, anchored on one reading at the midpoint of its
round trip and advanced by the monotonic clock, whatever this host's wall clock says."""

from __future__ import annotations

import asyncio

from backfill.clock import SharedClock
from tests.unit.support_clock import HandClock


def test_before_any_anchor_it_reads_the_host_clock() -> None:
    clock = SharedClock(host=lambda: 42.0, monotonic=HandClock(1000.0))
    assert not clock.anchored
    assert clock.now() == 42.0
    assert clock.due()


def test_a_reading_is_placed_at_the_midpoint_of_its_round_trip_and_then_advances() -> None:
    ticks = HandClock(1000.0)
    clock = SharedClock(host=lambda: 0.0, monotonic=ticks, refresh_s=10)
    clock.anchor(5000.0, sent_mono_s=1000.0, received_mono_s=1000.2)
    ticks.now = 1000.2
    assert abs(clock.now() - 5000.1) < 1e-9
    assert abs(clock.uncertainty_s - 0.1) < 1e-9
    ticks.now = 1005.1
    assert abs(clock.now() - 5005.0) < 1e-9
    assert not clock.due()
    ticks.now = 1010.1
    assert clock.due()


def test_the_host_clock_is_not_read_once_anchored_so_its_skew_and_jumps_do_not_matter() -> None:
    host = [1_000_000.0]
    ticks = HandClock(1000.0)
    clock = SharedClock(host=lambda: host[0], monotonic=ticks)
    clock.anchor(5000.0, 1000.0, 1000.0)
    host[0] += 3600  # the host's clock steps an hour
    ticks.now += 1
    assert clock.now() == 5001.0
    assert clock.offset_s() == 5001.0 - host[0]


def test_a_slower_reply_within_the_refresh_interval_does_not_replace_a_better_anchor() -> None:
    ticks = HandClock(1000.0)
    clock = SharedClock(host=lambda: 0.0, monotonic=ticks, refresh_s=10)
    clock.anchor(5000.0, 1000.0, 1000.002)
    clock.anchor(9999.0, 1001.0, 1003.0)  # a 2 s round trip: a poor reading
    ticks.now = 1001.001
    assert abs(clock.now() - 5001.0) < 1e-6
    ticks.now = 1011.0  # due: a reading as good will do, however late
    clock.anchor(6000.0, 1011.0, 1011.003)
    assert abs(clock.now() - (6000.0 - 0.0015)) < 1e-9


def test_a_stalled_reading_does_not_set_the_clock_back_until_the_anchor_is_stale() -> None:
    # Redis answers at once, but the loop resumes 3 s late: the reading, placed at the
    # midpoint of a 3 s round trip, would read 1.5 s behind. The good anchor stays, and the
    # next try waits a refresh interval; a poor reading is taken once the anchor is 60 s old.
    ticks = HandClock(1000.0)
    clock = SharedClock(host=lambda: 0.0, monotonic=ticks, refresh_s=10)
    clock.anchor(5000.0, 1000.0, 1000.002)
    ticks.now = 1013.0
    assert clock.due()
    clock.anchor(5011.999, 1011.999, 1015.0)  # the true time at 1015.0 is 5015.0
    ticks.now = 1015.0
    assert abs(clock.now() - 5015.0) < 0.01
    assert not clock.due()
    ticks.now = 1025.1
    assert clock.due()
    ticks.now = 1063.0
    clock.anchor(9999.0, 1061.0, 1063.0)  # 62 s after the anchor: stale, even a poor reading
    assert abs(clock.now() - 10000.0) < 1e-6


def test_refresh_reads_the_reference_only_when_due() -> None:
    ticks = HandClock(1000.0)
    clock = SharedClock(host=lambda: 0.0, monotonic=ticks, refresh_s=10)
    reads: list[float] = []

    async def read() -> float:
        reads.append(ticks.now)
        return 7000.0

    async def scenario() -> list[float]:
        first = await clock.refresh(read)
        ticks.now += 3
        second = await clock.refresh(read)
        ticks.now += 8
        third = await clock.refresh(read)
        return [first, second, third]

    assert asyncio.run(scenario()) == [7000.0, 7003.0, 7000.0]
    assert reads == [1000.0, 1011.0]
