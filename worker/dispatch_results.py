"""The result writer of a node's dispatcher: finished attempts are committed to Postgres in
small batches, and their leases go back only once their results are durable."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from backfill.errors import StoreUnavailable
from backfill.states import ItemState
from worker.dispatch_state import DispatcherState, Finished

log = logging.getLogger("backfill.worker")

# The result writer's waits between tries while Postgres is out of reach (doubling).
RESULT_RETRY_FIRST_S = 0.5
RESULT_RETRY_MAX_S = 10.0


class ResultWriter:
    """Writes what a node's attempts produced: an attempt's end is handed over with
    :meth:`put`, committed in a batch, and its lease released once it is durable."""

    def __init__(
        self, state: DispatcherState, items_ended: Callable[[Iterable[str]], None] | None = None
    ) -> None:
        self.state = state
        self.items_ended = items_ended
        """Told the batches whose items' ends were just made durable (a summary job's driver
        is woken by it: ``worker.summary_wake``); must not block."""
        # None is the writer's signal to commit what it holds and stop.
        self.results: asyncio.Queue[Finished | None] = asyncio.Queue()

    async def put(self, finished: Finished | None) -> None:
        """Hand an attempt's end over to be written (None: commit what is held, and stop)."""
        await self.results.put(finished)

    async def write_results(self) -> None:
        """Commit results in small batches; returns after the stop signal (None)."""
        while True:
            first = await self.results.get()
            if first is None:
                return
            batch = [first]
            await asyncio.sleep(self.state.config.result_flush_s)
            stopping = False
            while not self.results.empty() and len(batch) < 256:
                entry = self.results.get_nowait()
                if entry is None:
                    stopping = True
                    break
                batch.append(entry)
            await self._commit_results(batch)
            if stopping:
                return

    async def flush_results(self) -> None:
        batch = []
        while not self.results.empty():
            entry = self.results.get_nowait()
            if entry is not None:
                batch.append(entry)
        if batch:
            await self._commit_results(batch)

    async def _commit_results(self, batch: list[Finished]) -> None:
        wait_s = RESULT_RETRY_FIRST_S
        while True:
            try:
                applied = set(
                    await asyncio.to_thread(self.state.repo.items.finish, [f for f, _ in batch])
                )
                break
            except StoreUnavailable as exc:
                # Results stay in memory (their leases held) until Postgres is back.
                log.warning(
                    "node %s: cannot write results: %s; retrying in %.1f s",
                    self.state.config.node,
                    exc,
                    wait_s,
                )
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, RESULT_RETRY_MAX_S)
            except Exception:
                # Not the store's absence but a fault retrying will not clear. The writer must
                # live on: this batch is dropped unwritten, its items stop being heartbeated
                # and the reaper requeues them (their lost runs count against the cap).
                log.exception(
                    "node %s: results could not be written; dropped", self.state.config.node
                )
                applied = set()
                break
        if self.items_ended is not None and applied:
            self.items_ended(
                {flight.item.job_id for fin, flight in batch if fin.item_id in applied}
            )
        for fin, flight in batch:
            if fin.item_id in applied:
                if fin.state is ItemState.SUCCEEDED:
                    self.state.stats.succeeded += 1
                    self.state.stats.output_tokens += fin.output_tokens
                else:
                    self.state.stats.failed += 1
            else:
                self.state.stats.stale_results += 1
            self.state.forget(flight)
        # Leases go back only once the results they produced are durable.
        await self.state.release_leases([flight.lease for _, flight in batch])
