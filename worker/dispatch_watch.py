"""What a node's dispatcher watches beside its attempts: heartbeats of claims and leases,
preemption notices, the engine's KV use, its step scheduler and its stalls, and the work
budget's control step. Each watch reads, asks a plan of ``backfill.dispatch`` which attempts
to stop, and stops them; the attempts' own tasks carry out what stopping means."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from backfill.clock import redis_time
from backfill.dispatch import (
    StopReason,
    budget_opened,
    budget_signals,
    claims_due,
    heartbeat_stop,
    prefilling,
    stalled,
    ttft_victims,
)
from backfill.engine.http import read_engine_scheduler
from backfill.engine_scheduler import publish_scheduler
from backfill.errors import BackfillError, LedgerUnavailable, StoreUnavailable
from backfill.ledger import HeartbeatResult, LeaseStatus
from backfill.observe import (
    allocated_over_reserved,
    engine_held_tokens,
    observed_non_batch,
    reserved_around,
)
from backfill.work_bell import rung_for
from backfill.work_budget import WorkBudget, describe, step
from backfill.work_signals import (
    BudgetView,
    InteractiveSignals,
    exchange_batch_awaiting,
    publish_budget,
    read_signals,
)
from worker.dispatch_state import DispatcherState, Flight

log = logging.getLogger("backfill.worker")


class Watchers:
    """The watches a node's dispatcher runs beside its attempts (each a task of its run)."""

    def __init__(self, state: DispatcherState) -> None:
        self.state = state

    async def beat_claims(self) -> None:
        """Extend each claim in Postgres when it is due (``claims_due``), and stop the attempts
        whose claim is gone. Beats on its own clock: a ledger that answers late (a shard
        failing over, a stalled server) does not hold a claim's extension up."""
        cfg = self.state.config
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            sent = time.monotonic()
            # Attempts being stopped too: their claims stand until their ends are written.
            flights = list(self.state.flights.values())
            due = set(
                claims_due(
                    {f.item.id: f.claim_extended_at for f in flights},
                    sent,
                    cfg.heartbeat_interval_s,
                    cfg.lease_ttl_s,
                )
            )
            if not due:
                continue
            try:
                extended = set(
                    await asyncio.to_thread(
                        self.state.repo.claims.heartbeat,
                        [(f.item.id, f.item.attempt) for f in flights if f.item.id in due],
                        cfg.lease_ttl_s,
                    )
                )
            except StoreUnavailable:
                continue  # each claim stands as it is; the next beat tries again
            for flight in flights:
                if flight.item.id not in due:
                    continue
                if flight.item.id in extended:
                    flight.claim_extended_at = sent
                elif (reason := heartbeat_stop(False, None)) is not None:
                    self.state.cancel(flight, reason)

    async def beat_leases(self) -> None:
        """Extend every lease of the node in the ledger (one round trip), and stop the attempts
        whose lease was preempted or is lost. Beats on its own clock: a Postgres that answers
        late does not hold a lease's extension up."""
        cfg = self.state.config
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            # Attempts being stopped too (their leases stand until released), but not those
            # whose claim is gone: nothing is to be written for them.
            flights = [
                f for f in self.state.flights.values() if f.stop_reason is not StopReason.CLAIM_LOST
            ]
            if not flights:
                continue
            try:
                beats = await self.state.ledger.heartbeat_many(
                    cfg.node,
                    [(f.lease.lease_id, f.lease.fencing_token) for f in flights],
                    ttl_ms=int(cfg.lease_ttl_s * 1000),
                )
            except BackfillError:
                continue  # each lease stands as it is; the next beat tries again
            for flight, beat in zip(flights, beats, strict=True):
                if not isinstance(beat, HeartbeatResult):
                    continue  # this lease's call failed: left as it is
                reason = heartbeat_stop(True, beat.status)
                if reason is not None:
                    self.state.cancel(flight, reason)
                elif beat.status is LeaseStatus.UNKNOWN:
                    await self._lease_missing(flight)

    async def _lease_missing(self, flight: Flight) -> None:
        """The ledger has no trace of a lease this worker holds: Redis lost writes (a restart,
        or a replica promoted before a write reached it). The attempt is still live in
        Postgres, so the work goes on; the node is closed to batch until the next maintenance
        tick rebuilds its ledger from Postgres, which counts the lease again (until then its
        tokens may be handed out twice: the window is one heartbeat plus one tick)."""
        try:
            if await self.state.ledger.mark_incomplete(self.state.config.node):
                log.warning(
                    "node %s: lease %s of item %s is missing from the ledger; batch closed "
                    "on the node until it is rebuilt from Postgres",
                    self.state.config.node,
                    flight.lease.lease_id,
                    flight.item.id,
                )
        except BackfillError as exc:
            log.warning("node %s: could not close for a rebuild: %s", self.state.config.node, exc)

    async def observe(self) -> None:
        """Tell the ledger how much of the engine's KV cache batch does not account for:
        interactive traffic that bypassed the gateway still narrows batch slack."""
        cfg = self.state.config
        while True:
            await asyncio.sleep(cfg.observe_interval_s)
            try:
                # The engine read fresh between two ledger snapshots: the invariant's check
                # compares it with what either held (``reserved_around``).
                before = await self.state.ledger.snapshot(cfg.node)
                load = (await self.state.engine_load.read(0.0)).load
                snap = await self.state.ledger.snapshot(cfg.node)
                if snap is None or before is None:
                    continue
                # Output streams in chunks of ``stream_interval`` tokens: the engine may hold
                # up to ``stream_interval - 1`` more tokens of a sequence than the worker saw.
                unseen = cfg.stream_interval - 1
                in_engine = {
                    f.lease.lease_id: f.prompt_tokens + f.generated + unseen
                    for f in self.state.flights.values()
                }
                # With nothing running or waiting, no sequence holds KV: what the gauge still
                # says is free-able prefix cache, or a value from the engine's last step that
                # no step has refreshed. Trusting it could keep batch out of an idle engine,
                # and batch is what would have made the engine step again.
                idle = load.num_requests_running == 0 and load.num_requests_waiting == 0
                usage = 0.0 if idle else load.kv_cache_usage_perc
                observed = observed_non_batch(
                    usage, snap.capacity_tokens, snap.block_size, snap.leases, in_engine
                )
                reserved = reserved_around(before, snap)
                over = allocated_over_reserved(
                    engine_held_tokens(usage, snap.capacity_tokens, snap.block_size), reserved
                )
                if over > 0:
                    self.state.stats.over_reserved_samples += 1
                    self.state.stats.over_reserved_max = max(
                        self.state.stats.over_reserved_max, over
                    )
                    log.warning(
                        "node %s: the engine holds %d KV tokens above the %d the ledger reserved "
                        "(%d of them shared prefixes)",
                        cfg.node,
                        over,
                        reserved,
                        snap.prefix_tokens,
                    )
                await self.state.ledger.observe(cfg.node, observed, over_reserved_tokens=over)
            except Exception as exc:  # a missed report only leaves the last one standing
                log.warning("node %s: engine use not observed: %s", cfg.node, exc)

    async def watch_scheduler(self) -> None:
        """Read the engine scheduler's metrics: whether it runs (and so pauses batch), and
        what it did, published for ``/v1/capacity``."""
        cfg = self.state.config
        url = cfg.scheduler_metrics_url
        assert url is not None
        while True:
            seen = await read_engine_scheduler(url)
            if seen is not None:
                seen = replace(seen, worker_batch_priority=cfg.batch_priority)
                was = self.state.engine_scheduler
                if not seen.agrees and (was is None or was.agrees):
                    log.error(
                        "node %s: the engine's scheduler takes priority >= %d as batch, this "
                        "worker sends batch at %d: the work budget keeps preempting for "
                        "interactive TTFT (set BACKFILL_SCHED_BATCH_PRIORITY on the engine "
                        "and BACKFILL_BATCH_PRIORITY here to one value)",
                        cfg.node,
                        seen.batch_priority,
                        cfg.batch_priority,
                    )
            if (seen is None) != (self.state.engine_scheduler is None):
                if seen is None:
                    said = f"no engine scheduler answers at {url}: the work budget preempts"
                elif seen.agrees:
                    said = f"the engine runs {seen.name}: it pauses batch for interactive work"
                else:
                    said = (
                        f"the engine runs {seen.name}, which is not trusted to pause this "
                        "worker's batch (their batch priorities differ): the work budget preempts"
                    )
                log.info("node %s: %s", cfg.node, said)
            self.state.engine_scheduler = seen
            if seen is not None:
                with contextlib.suppress(Exception):
                    await publish_scheduler(
                        self.state.ledger.client,
                        self.state.ledger.keys,
                        cfg.node,
                        seen,
                        3 * cfg.scheduler_poll_s,
                    )
            await asyncio.sleep(cfg.scheduler_poll_s)

    async def watch_stalls(self) -> None:
        """Stop the attempts a hung engine holds (see ``DispatchConfig.stall_timeout_s``)."""
        timeout = self.state.config.stall_timeout_s
        interval = min(5.0, max(timeout / 4, 0.05))
        progress: int | None = None
        progressed_at = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                load = (await self.state.engine_load.read(interval)).load
                seen: int | None = load.prompt_tokens_total + load.generation_tokens_total
            except Exception as exc:  # no answer at all is no progress
                log.debug(
                    "node %s: no engine load for the stall watch: %s", self.state.config.node, exc
                )
                seen = None
            now = time.monotonic()
            if seen is not None and seen != progress:
                progress, progressed_at = seen, now
            stuck = stalled(self.state.view().running, progressed_at, now, timeout)
            for flight in self.state.flights_of(stuck):
                if self.state.cancel(flight, StopReason.STALLED):
                    self.state.stats.stalls += 1
                    self.state.engine_suspect = True
                    log.warning(
                        "node %s: item %s attempt %s: no output for %.0f s and no engine "
                        "progress; stopping it as an engine error",
                        self.state.config.node,
                        flight.item.id,
                        flight.item.attempt,
                        now - flight.last_chunk_at,
                    )

    async def control_budget(self) -> None:
        """Step the work budget from fresh signals, preempt what it says, publish it."""
        cfg = self.state.config
        try:
            await self.state.clock.sync(redis_time(self.state.ledger.client))
            if self.state.work_budget is not None and cfg.work_budget is not None:
                self.state.work_budget = WorkBudget.initial(cfg.work_budget, self.state.clock.now())
        except Exception as exc:  # the first step tries again
            log.debug("node %s: Redis' clock not read: %s", cfg.node, exc)
        while True:
            await asyncio.sleep(self.budget_interval_s())
            try:
                await self._step_budget()
            except Exception as exc:  # a missed step leaves the last budget standing
                log.warning("node %s: work budget not stepped: %s", cfg.node, exc)

    def budget_interval_s(self) -> float:
        """How often the work budget steps now: less often while the engine's step scheduler
        pauses batch itself."""
        cfg = self.state.config
        if self.state.engine_pauses_batch:
            return cfg.budget_interval_with_scheduler_s
        return cfg.budget_interval_s

    async def _step_budget(self) -> None:
        """One step of the work budget: read the signals (Redis' clock, the gateway's
        signals, the engine's queue, the node's other workers), take the budget's step
        (``backfill.work_budget.step``, pure), carry out what it decided, publish it."""
        cfg = self.state.config
        policy, before = cfg.work_budget, self.state.work_budget
        if policy is None or before is None:
            return
        now = await self._redis_now()
        try:
            seen = await read_signals(
                self.state.ledger.client, self.state.ledger.keys, cfg.node, cfg.signal_ttl_s, now
            )
        except Exception as exc:  # Redis trouble: judge by the engine's queue alone
            log.debug("node %s: no gateway signals: %s", cfg.node, exc)
            seen = InteractiveSignals()
        interval = self.budget_interval_s()
        engine_waiting, read_at = await self._engine_waiting(interval)
        view = self.state.view(before)
        active = self.state.flights_of(view.active)
        awaiting = sum(1 for f in view.active if f.first_token_at is None)
        others_awaiting = await self._others_awaiting(awaiting, interval, now)
        signals = budget_signals(
            view,
            seen,
            now_s=now,
            engine_waiting=engine_waiting,
            engine_read_at=read_at,
            other_batch_awaiting=others_awaiting,
        )
        decision = step(before, signals, policy)
        budget = self.state.work_budget = decision.budget
        if decision.changed:
            log.info("node %s: work budget %s", cfg.node, describe(budget))
        self._preempt_for_ttft(decision.preempt, decision.reason)
        if budget_opened(before, budget):
            self.state.room.set()
        # These attempts as they are now: a first token may have come during the reads.
        in_prefill = prefilling(tuple(f.view() for f in active))
        published = BudgetView.of(budget, len(active), in_prefill, now)
        with contextlib.suppress(Exception):
            await publish_budget(
                self.state.ledger.client,
                self.state.ledger.keys,
                cfg.node,
                self.state.worker_id,
                published,
                max(5.0, cfg.signal_ttl_s),
            )

    async def _redis_now(self) -> float:
        """Redis' clock now, or (Redis in trouble) the last anchor's reckoning."""
        try:
            return await self.state.clock.refresh(redis_time(self.state.ledger.client))
        except Exception as exc:
            log.debug("node %s: Redis' clock not read: %s", self.state.config.node, exc)
            return self.state.clock.now()

    async def _engine_waiting(self, interval: float) -> tuple[int | None, float]:
        """The engine's waiting requests and when they were read (None: its metrics are
        missing, and the gateway's signals judge alone)."""
        asked_at = time.monotonic()
        try:
            reading = await self.state.engine_load.read(interval / 2)
        except Exception as exc:
            log.debug("node %s: no engine load: %s", self.state.config.node, exc)
            return None, asked_at
        return reading.load.num_requests_waiting, reading.read_at

    async def _others_awaiting(self, awaiting: int, interval: float, now: float) -> int:
        """Batch attempts awaiting their first token on this node's other workers (0: Redis
        in trouble, as if this worker were the node's only one); this worker's count given."""
        try:
            return await exchange_batch_awaiting(
                self.state.ledger.client,
                self.state.ledger.keys,
                self.state.config.node,
                self.state.worker_id,
                awaiting,
                max(1.0, 4 * interval),
                now,
            )
        except Exception as exc:
            log.debug("node %s: other workers' batch not read: %s", self.state.config.node, exc)
            return 0

    def _preempt_for_ttft(self, preempt: int, reason: str) -> None:
        """Stop the batch attempts the budget's step chose for interactive TTFT, unless the
        engine's step scheduler pauses batch itself."""
        pauses = self.state.engine_pauses_batch
        if preempt and pauses:
            log.debug(
                "node %s: no TTFT preemption: the engine pauses batch", self.state.config.node
            )
        victims = ttft_victims(preempt, pauses, self.state.view().running)
        stopped = sum(
            self.state.cancel(f, StopReason.PREEMPTED) for f in self.state.flights_of(victims)
        )
        self.state.stats.budget_preemptions += stopped
        if stopped:
            log.info(
                "node %s: preempted %s batch item(s) for interactive TTFT (%s)",
                self.state.config.node,
                stopped,
                reason,
            )

    def _note_early_preemption(self, lease_id: str) -> None:
        """Keep a notice for a lease not registered (yet): another worker's on this node, or
        one of ours between its reservation and its start. Kept a minute (a start takes
        milliseconds), at most a few thousand."""
        now = time.monotonic()
        if len(self.state.early_preemptions) >= 4096:
            self.state.early_preemptions = {
                k: t for k, t in self.state.early_preemptions.items() if now - t < 60.0
            }
            if len(self.state.early_preemptions) >= 4096:
                self.state.early_preemptions.pop(next(iter(self.state.early_preemptions)))
        self.state.early_preemptions[lease_id] = now

    async def listen_preemptions(self) -> None:
        while True:
            try:
                async with await self.state.ledger.listen_preemptions(
                    self.state.config.node
                ) as listener:
                    async for lease_id in listener:
                        item_id = self.state.by_lease.get(lease_id)
                        flight = self.state.flights.get(item_id) if item_id is not None else None
                        if flight is not None:
                            self.state.cancel(flight, StopReason.PREEMPTED)
                        elif item_id is None:
                            self._note_early_preemption(lease_id)
            except LedgerUnavailable as exc:
                log.warning("node %s: preemption channel lost: %s", self.state.config.node, exc)
                await asyncio.sleep(1.0)

    async def listen_claimable(self, heard: Callable[[], None]) -> None:
        """Call ``heard`` whenever a job of this node's model becomes claimable
        (``backfill.work_bell``): the idle claim loop and prefix finder look now."""
        model = self.state.model
        while True:
            try:
                async with await self.state.ledger.listen_claimable() as listener:
                    async for rung in listener:
                        if rung_for(rung, model):
                            heard()
            except LedgerUnavailable as exc:
                log.warning("node %s: work bell lost: %s", self.state.config.node, exc)
                await asyncio.sleep(1.0)
