"""One simulated GPU node of ``bench.fleet``: a worker's control plane, its engine a schedule.

:class:`SimNode` makes the calls ``worker.dispatch.NodeDispatcher`` makes, in its order and
batching, and with its pacing:

- fill (``_fill``): ledger snapshot; then the plane's ``claim_to_start``: an open claim of
  ``min(room, claim_batch)``, fewer when the slack judged by recent reservations is short;
  snapshot again and leave what the slack cannot take (``fit_to_slack``: ``unclaim``, no write
  for Backfill); ``reserve_many`` for the rest (one round trip); ``start_many`` starts the
  leased and holds the denied; then the denied are given back one by one (deferred); orphans
  released. The prompts are not counted on an engine (there is none): items carry their
  counts, as items do after a first attempt. A claim that started something is followed at
  once by the next; otherwise the loop waits ``idle_poll_s`` or until an item leaves (the
  dispatcher's room event).
- generation (``_run``): a ledger ``settle`` each time an item's output grew by
  ``settle_every_tokens``, each awaited on its own (one task per item in the dispatcher);
  tokens come when the timing model (``bench.fleet.model``) says.
- results (``_write_results``): finished items queue to one writer that waits
  ``result_flush_s``, takes up to 256, ``finish``es them in one statement, then
  ``release_many``.
- heartbeat (``_heartbeat``) every ``heartbeat_interval_s``: one Postgres heartbeat of the
  held items whose claim is due (``claims_due``), then one ledger call heartbeating every
  lease (pipelined): the worker's calls (it makes the two on clocks of their own).
- observe (``_observe``) every second: snapshot + observe; work budget (``_step_budget``) every
  ``budget_interval_s``: Redis' clock, the gateway signals, the batch exchange, the publish.
- a preemption listener (one pub/sub subscription) per node.

:class:`bench.fleet.plane.BackfillPlane` carries those calls out with Backfill's
``Repository`` and ``AsyncLedger``; :class:`bench.fleet.raw_plane.RawPlane` with the bare
statements and Redis calls of the same shape, without Backfill's logic: the floor the benchmark
compares with.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis.asyncio

from backfill.clock import redis_time
from backfill.dispatch import claims_due
from backfill.errors import BackfillError
from backfill.work_budget import WorkBudget, WorkBudgetPolicy, WorkSignals, step
from backfill.work_signals import (
    BudgetView,
    exchange_batch_awaiting,
    publish_budget,
    read_signals,
)
from bench.fleet.model import NodeModel, Timeline
from bench.fleet.plane import Held, NodeConfig, Plane
from bench.fleet.stats import Histogram

T = TypeVar("T")


@dataclass
class NodeCounters:
    started: int = 0
    finished: int = 0
    output_tokens: int = 0
    claims: int = 0
    claimed: int = 0
    unclaimed: int = 0
    deferred: int = 0


@dataclass
class _Flight:
    held: Held
    timeline: Timeline
    generated: int = 0
    claim_extended_at: float = field(default_factory=time.monotonic)


@dataclass
class Recorder:
    """Latency histograms of one process's calls, by name."""

    hist: dict[str, Histogram] = field(default_factory=dict)
    measuring: bool = False

    async def timed(self, name: str, call: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await call
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        if self.measuring:
            h = self.hist.get(name)
            if h is None:
                h = self.hist[name] = Histogram()
            h.add(seconds)


async def cancel_all(tasks: Sequence[asyncio.Task[Any]], attempts: int = 50) -> None:
    """Cancel ``tasks`` until they are done: a cancellation that lands inside a Redis call
    comes out as a connection error, which the loops here survive, so one may not be enough."""
    for _ in range(attempts):
        pending = [t for t in tasks if not t.done()]
        if not pending:
            return
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=0.2)


class SimNode:
    """One node's dispatcher loop against ``plane``, its tokens timed by ``model``."""

    def __init__(
        self,
        name: str,
        plane: Plane,
        model: NodeModel,
        cfg: NodeConfig,
        rec: Recorder,
        budget_policy: WorkBudgetPolicy | None,
        output_tokens: int,
    ) -> None:
        self.name, self.plane, self.model, self.cfg, self.rec = name, plane, model, cfg, rec
        self.budget_policy = budget_policy
        self.output_tokens = output_tokens
        self.counters = NodeCounters()
        self._flights: dict[int, _Flight] = {}
        self._events: list[tuple[float, int, int, _Flight]] = []
        self._seq = itertools.count()
        self._wake_engine = asyncio.Event()
        self._room = asyncio.Event()
        self._stopping = asyncio.Event()
        self._results: asyncio.Queue[tuple[Held, int]] = asyncio.Queue()
        self._typical_reservation = 0
        self._worker_id = uuid.uuid4().hex
        self._progress: dict[int, tuple[Held, int]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._drain = True

    def stop(self, *, drain: bool = True) -> None:
        """Stop claiming; with ``drain``, what runs finishes first (a worker's grace)."""
        self._drain = drain
        self._stopping.set()
        self._room.set()

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    async def run(self) -> None:
        helpers = [
            asyncio.create_task(self._engine()),
            asyncio.create_task(self._write_results()),
            asyncio.create_task(self._every(self.cfg.heartbeat_interval_s, self._heartbeat)),
            asyncio.create_task(self._every(self.cfg.observe_interval_s, self._observe)),
            asyncio.create_task(self._listen()),
        ]
        if self.budget_policy is not None:
            helpers.append(
                asyncio.create_task(self._every(self.cfg.budget_interval_s, self._step_budget))
            )
        if self.cfg.settle_batched:
            helpers.append(
                asyncio.create_task(self._every(self.cfg.settle_interval_s, self._settle_progress))
            )
        try:
            while not self._stopping.is_set():
                try:
                    started = await self._fill()
                except BackfillError:
                    started = 0
                    await asyncio.sleep(1.0)
                if started == 0:
                    await self._sleep(self.cfg.idle_poll_s)
            # Drain: what runs finishes (a real worker's grace period).
            while self._flights and self._drain:
                await asyncio.sleep(0.1)
        finally:
            await cancel_all(helpers)

    async def _sleep(self, seconds: float) -> None:
        self._room.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room.wait(), seconds)

    async def _every(self, interval: float, job: Callable[[], Awaitable[None]]) -> None:
        # Nodes start at random phases, as a fleet's do.
        await asyncio.sleep(random.uniform(0, interval))
        while not self._stopping.is_set():
            with contextlib.suppress(BackfillError):
                await job()
            await asyncio.sleep(interval)

    # -- fill: NodeDispatcher._fill, _reserve, _fit_to_slack, _start_claim

    async def _fill(self) -> int:
        cfg, rec = self.cfg, self.rec
        room = cfg.max_in_flight - len(self._flights)
        if room <= 0:
            return 0
        slack = await rec.timed("snapshot", self.plane.snapshot(self.name))
        if slack < cfg.block_size:
            return 0
        want = min(room, cfg.claim_batch)
        if self._typical_reservation:
            want = max(1, min(want, slack // self._typical_reservation))
        opened = await rec.timed(
            "claim_to_start",
            self.plane.claim_to_start(self.name, want, cfg.lease_ttl_s, cfg.block_size),
        )
        for name, seconds in opened.timings:
            rec.add(name, seconds)
        self.counters.claims += 1
        if not opened.claimed:
            return 0
        self.counters.claimed += len(opened.claimed)
        self.counters.unclaimed += len(opened.claimed) - opened.fits
        for h in opened.leased:
            tokens = h.lease.tokens
            self._typical_reservation = (
                tokens
                if not self._typical_reservation
                else (3 * self._typical_reservation + tokens) // 4
            )
        # The refused are settled after the start (their rows were the claim's until then).
        for h in opened.refused:
            self.counters.deferred += 1
            await rec.timed("give_back", self.plane.give_back(h))
        orphans = [h for h in opened.leased if h.item_id not in opened.applied]
        if orphans:
            await rec.timed("release", self.plane.release(orphans))
        started = [h for h in opened.leased if h.item_id in opened.applied]
        self._schedule(started)
        self.counters.started += len(started)
        return len(started)

    def _schedule(self, started: Sequence[Held]) -> None:
        outputs = [min(self.output_tokens, h.max_output_tokens) for h in started]
        timelines = self.model.start(
            time.monotonic(),
            [h.prompt_tokens for h in started],
            outputs,
            len(self._flights),
            self.cfg.settle_every_tokens,
        )
        for h, tl in zip(started, timelines, strict=True):
            flight = _Flight(h, tl)
            self._flights[h.item_id] = flight
            if not self.cfg.settle_batched:
                for when, generated in tl.settles():
                    heapq.heappush(self._events, (when, next(self._seq), generated, flight))
            heapq.heappush(self._events, (tl.done_at, next(self._seq), -1, flight))
        self._wake_engine.set()

    # -- the engine: tokens when the timing model says

    async def _engine(self) -> None:
        while True:
            if not self._events:
                self._wake_engine.clear()
                await self._wake_engine.wait()
                continue
            delay = self._events[0][0] - time.monotonic()
            if delay > 0:
                self._wake_engine.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake_engine.wait(), delay)
                continue
            now = time.monotonic()
            settles: list[tuple[_Flight, int]] = []
            while self._events and self._events[0][0] <= now:
                _, _, generated, flight = heapq.heappop(self._events)
                if generated < 0:
                    flight.generated = flight.timeline.output_tokens
                    self._progress.pop(flight.held.item_id, None)
                    self._results.put_nowait((flight.held, flight.generated))
                else:
                    flight.generated = generated
                    settles.append((flight, generated))
            for flight, generated in settles:
                # Each item's task awaits its own settle in the dispatcher.
                t = asyncio.create_task(
                    self.rec.timed("settle", self.plane.settle(self.name, flight.held, generated))
                )
                self._tasks.add(t)
                t.add_done_callback(self._tasks.discard)

    async def _settle_progress(self) -> None:
        """The batched form: every running item's progress in one call per interval."""
        now = time.monotonic()
        progress = []
        for f in self._flights.values():
            tl = f.timeline
            if now < tl.first_token_at or now >= tl.done_at:
                continue
            generated = 1 + int((now - tl.first_token_at) / tl.token_s)
            if generated - f.generated >= self.cfg.settle_every_tokens:
                f.generated = generated
                progress.append((f.held, generated))
        if progress:
            await self.rec.timed("settle", self.plane.settle_many(self.name, progress))

    # -- results: ResultWriter.write_results, _commit_results (worker.dispatch_results)

    async def _write_results(self) -> None:
        while not self._stopping.is_set() or not self._results.empty():
            first = await self._results.get()
            batch = [first]
            await asyncio.sleep(self.cfg.result_flush_s)
            while not self._results.empty() and len(batch) < 256:
                batch.append(self._results.get_nowait())
            applied = await self.rec.timed("finish", self.plane.finish(batch))
            for held, out in batch:
                if held.item_id in applied:
                    self.counters.finished += 1
                    self.counters.output_tokens += out
                self._flights.pop(held.item_id, None)
            self._room.set()
            await self.rec.timed("release", self.plane.release([h for h, _ in batch]))

    # -- heartbeats, observe, work budget, preemption notices

    async def _heartbeat(self) -> None:
        flights = list(self._flights.values())
        if not flights:
            return
        cfg = self.cfg
        sent = time.monotonic()
        due = set(
            claims_due(
                {f.held.item_id: f.claim_extended_at for f in flights},
                sent,
                cfg.heartbeat_interval_s,
                cfg.lease_ttl_s,
            )
        )
        if due:
            extended = await self.rec.timed(
                "heartbeat_pg",
                self.plane.heartbeat_claims(
                    [f.held for f in flights if f.held.item_id in due], cfg.lease_ttl_s
                ),
            )
            for f in flights:
                if f.held.item_id in extended:
                    f.claim_extended_at = sent
        await self.rec.timed(
            "heartbeat",
            self.plane.heartbeat_leases(self.name, [f.held for f in flights], cfg.lease_ttl_s),
        )

    async def _observe(self) -> None:
        await self.rec.timed("observe", self.plane.observe(self.name))

    async def _step_budget(self) -> None:
        policy = self.budget_policy
        assert policy is not None
        client, keys = self.plane.client, self.plane.keys
        t0 = time.perf_counter()
        now = await redis_time(client)()
        seen = await read_signals(client, keys, self.name, self.cfg.signal_ttl_s, now)
        awaiting = sum(
            1 for f in self._flights.values() if time.monotonic() < f.timeline.first_token_at
        )
        others = await exchange_batch_awaiting(
            client,
            keys,
            self.name,
            self._worker_id,
            awaiting,
            max(1.0, 4 * self.cfg.budget_interval_s),
            now,
        )
        decision = step(
            WorkBudget.initial(policy, now),
            WorkSignals(
                now_s=now,
                interactive_waiting=seen.waiting,
                interactive_prefilling=seen.prefilling,
                oldest_pending_since_s=seen.oldest_pending_since_s,
                ttfts=seen.ttfts,
                engine_waiting=0,
                batch_in_flight=len(self._flights),
                batch_awaiting_first_token=awaiting,
                other_batch_awaiting_first_token=others,
            ),
            policy,
        )
        view = BudgetView.of(decision.budget, len(self._flights), 0, now)
        await publish_budget(
            client, keys, self.name, self._worker_id, view, max(5.0, self.cfg.signal_ttl_s)
        )
        if self.rec.measuring:
            self.rec.hist.setdefault("work_budget", Histogram()).add(time.perf_counter() - t0)

    async def _listen(self) -> None:
        with contextlib.suppress(BackfillError, redis.RedisError):
            await self.plane.listen(self.name)
