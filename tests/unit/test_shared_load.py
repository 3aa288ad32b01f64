"""The worker's loops share one read of the engine's load when a young enough one exists."""

from __future__ import annotations

import asyncio

import pytest

from backfill.engine.shared_load import SharedLoad
from backfill.engine_metrics import EngineLoad
from tests.unit.support_clock import HandClock


class CountingEngine:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.reads = 0
        self.delay_s = delay_s
        self.fail = False

    async def load(self) -> EngineLoad:
        self.reads += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise ConnectionError("engine gone")
        return EngineLoad(0.0, 0, self.reads, 0, 0, 0)


def test_a_young_reading_is_shared_and_an_old_one_read_again() -> None:
    engine, clock = CountingEngine(), HandClock(100.0)
    shared = SharedLoad(engine, clock=clock)  # type: ignore[arg-type]

    async def go() -> None:
        first = await shared.read(1.0)
        assert (first.read_at, first.load.num_requests_waiting) == (100.0, 1)
        clock.now = 100.9
        assert await shared.read(1.0) is first
        assert (await shared.read(0.5)).load.num_requests_waiting == 2
        clock.now = 102.0
        assert (await shared.read(5.0)).read_at == 100.9

    asyncio.run(go())
    assert engine.reads == shared.reads == 2


def test_loops_asking_at_once_share_one_read() -> None:
    engine = CountingEngine(delay_s=0.05)
    shared = SharedLoad(engine)  # type: ignore[arg-type]

    async def go() -> list[int]:
        readings = await asyncio.gather(*(shared.read(1.0) for _ in range(5)))
        return [r.load.num_requests_waiting for r in readings]

    assert asyncio.run(go()) == [1] * 5
    assert engine.reads == 1


def test_a_failed_read_is_raised_and_not_remembered() -> None:
    engine, clock = CountingEngine(), HandClock(100.0)
    shared = SharedLoad(engine, clock=clock)  # type: ignore[arg-type]

    async def go() -> None:
        engine.fail = True
        with pytest.raises(ConnectionError):
            await shared.read(10.0)
        engine.fail = False
        assert (await shared.read(10.0)).load.num_requests_waiting == 2

    asyncio.run(go())
