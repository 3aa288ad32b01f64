"""One engine's load, read once and shared by every loop of a worker that needs it.

A worker reads its engine's ``/metrics`` for three things: the work budget (is interactive
work queued beside batch?), the KV observer (how much of the cache is not batch's?) and the
stall watch (is the engine making progress?). vLLM renders that page in its API server
process, ~5 ms of CPU a read; on a node whose engine shares its CPU cores (a CPU engine, a
small GPU host) every read is taken from the engine's own steps. So each loop says how old a
reading it can use, a young enough one is shared, and loops asking at once share one read.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from backfill.engine.protocol import Engine
from backfill.engine_metrics import EngineLoad


@dataclass(frozen=True, slots=True)
class LoadReading:
    load: EngineLoad
    read_at: float
    """When the read began (the caller's monotonic clock): the engine's figures are no
    older than this."""


class SharedLoad:
    """The engine's load, read at most once per asker's tolerance."""

    def __init__(self, engine: Engine, clock: Callable[[], float] = time.monotonic) -> None:
        self._engine = engine
        self._clock = clock
        self._last: LoadReading | None = None
        self._lock = asyncio.Lock()
        self.reads = 0
        """Reads of the engine made (the rest were shared)."""

    async def read(self, max_age_s: float) -> LoadReading:
        """A reading begun at most ``max_age_s`` ago: the last one if it is that young,
        else a fresh one (one read for everyone asking meanwhile). Raises what the engine's
        ``load()`` raises; a failed read is not remembered."""
        async with self._lock:
            last = self._last
            if last is not None and self._clock() - last.read_at <= max_age_s:
                return last
            read_at = self._clock()
            load = await self._engine.load()
            self.reads += 1
            self._last = LoadReading(load, read_at)
            return self._last
