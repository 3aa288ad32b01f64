"""The node dispatcher: feeds one engine from its batch slack, in deadline order.

One asyncio loop per GPU node, beside its vLLM server:

1. claim a batch of items in Postgres (fair share, earliest deadline first, ``SKIP
   LOCKED``), never more than the slack could admit, keeping the claim's transaction open:
   the items are locked for this node and not yet written;
2. count each prompt's tokens with the engine's own tokenizer; refuse what breaks the batch
   class limit, and expire what cannot finish before its deadline (before any prefill);
3. reserve ``prompt + max_output`` (block-rounded) per item from the node's batch slack in the
   ledger — one pipelined round trip; items the slack cannot take are left in the queue;
4. start the claim in one write and commit it: the leased items run under a new attempt
   (fenced by attempt and fencing token), the refused are settled, the rest unlock as they
   were; then stream each from the engine with the batch priority;
5. write results in batches and release each lease after its result is durable.

Interactive load takes precedence in two ways: it shrinks the slack (fewer new items), and the
ledger preempts running batch leases, which reaches this loop as a pub/sub notice (or, if the
notice is lost, as the lease's heartbeat status). A preempted item is aborted in the engine
(closing its stream frees its KV blocks), keeps its partial output, and resumes later from it.

What to claim, check, start, stop, retry or fail is decided by the plans of
``backfill.dispatch``, pure functions over a view of the dispatcher (``DispatcherState.view``);
the loop gathers the view, asks them, and carries the answers out: engine calls, Postgres and
ledger writes. :class:`NodeDispatcher` composes parts that each own one stage of an item's
life, all given the one :class:`~worker.dispatch_state.DispatcherState`: ``worker.dispatch_check``
counts and judges, ``worker.dispatch_attempts`` runs the attempts, ``worker.dispatch_results``
writes their results, ``worker.dispatch_watch`` watches leases, the engine and the work budget,
``worker.dispatch_prefixes`` finds shared prefixes. This module claims, reserves and starts, and
calls the parts in the order an item meets them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Iterable

from backfill.cancelling import cancel_and_wait
from backfill.clock import HostClock, SharedClock
from backfill.dispatch import (
    CheckedItem,
    DispatchConfig,
    Leased,
    NodeView,
    PrefixStarts,
    StartPlan,
    StopReason,
    after_reserve,
    claim_size,
    fit_starts,
    plan_prefix_starts,
    prefix_claim_hold_s,
    reserve_request,
    running_mean,
    start_room,
)
from backfill.engine.protocol import Engine, EngineError
from backfill.engine.shared_load import SharedLoad
from backfill.engine_scheduler import EngineScheduler
from backfill.errors import LedgerError, LedgerUnavailable, StoreUnavailable
from backfill.ledger import BatchLedger, Denial, Lease, PartialBatchError
from backfill.prefix_pass import PrefixJobs
from backfill.store import AttemptStore, OpenClaim
from backfill.work_budget import WorkBudget
from worker.dispatch_attempts import AttemptRunner
from worker.dispatch_check import Checker, Refused
from worker.dispatch_prefixes import PrefixFinding
from worker.dispatch_results import ResultWriter
from worker.dispatch_state import DispatcherState, DispatchStats, Flight
from worker.dispatch_watch import Watchers

__all__ = ["DispatchConfig", "DispatchStats", "NodeDispatcher"]

log = logging.getLogger("backfill.worker")

# The longest pause after a claim that failed on a fault of the worker's own (it doubles from
# a second with each failure in a row).
FILL_FAULT_MAX_S = 30.0


class NodeDispatcher:
    """Runs the claim -> check -> reserve -> start -> stream -> result -> release walk for
    one node. Its methods read in the walk's order: :meth:`_fill` claims, ``checker`` counts
    and judges, :meth:`_reserve` reserves, :meth:`_start_claim` starts, :meth:`_launch` hands
    each attempt to ``attempts``, whose stream's end goes to ``writer``, which releases its
    lease once its result is durable."""

    def __init__(
        self,
        config: DispatchConfig,
        engine: Engine,
        repo: AttemptStore,
        ledger: BatchLedger,
        *,
        model: str,
        block_size: int,
        max_sequence_tokens: int,
        host_clock: HostClock = time.time,
    ) -> None:
        self.state = state = DispatcherState(
            config,
            engine,
            repo,
            ledger,
            model=model,
            block_size=block_size,
            max_sequence_tokens=max_sequence_tokens,
            host_clock=host_clock,
        )
        self.checker = Checker(state)
        self.writer = ResultWriter(state)
        self.attempts = AttemptRunner(state, self.writer)
        self.watchers = Watchers(state)
        self.prefixes = PrefixFinding(state, self.checker)
        self._stopping = asyncio.Event()

    # -----------------------------------------------------------------------------------------
    # What callers read and set (the parts and the state hold it)

    @property
    def config(self) -> DispatchConfig:
        return self.state.config

    @property
    def repo(self) -> AttemptStore:
        return self.state.repo

    @property
    def clock(self) -> SharedClock:
        return self.state.clock

    @property
    def engine_load(self) -> SharedLoad:
        return self.state.engine_load

    @property
    def stats(self) -> DispatchStats:
        return self.state.stats

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    @property
    def work_budget(self) -> WorkBudget | None:
        return self.state.work_budget

    @property
    def engine_scheduler(self) -> EngineScheduler | None:
        return self.state.engine_scheduler

    @property
    def engine_pauses_batch(self) -> bool:
        return self.state.engine_pauses_batch

    def view(self, budget: WorkBudget | None = None) -> NodeView:
        return self.state.view(budget)

    @property
    def prefix_jobs(self) -> PrefixJobs | None:
        """Where the prefix finder takes jobs to look at (None: it does not run)."""
        return self.prefixes.prefix_jobs

    @prefix_jobs.setter
    def prefix_jobs(self, jobs: PrefixJobs | None) -> None:
        self.prefixes.prefix_jobs = jobs

    @property
    def items_ended(self) -> Callable[[Iterable[str]], None] | None:
        """Told the batches whose items' ends were just made durable (``ResultWriter``)."""
        return self.writer.items_ended

    @items_ended.setter
    def items_ended(self, told: Callable[[Iterable[str]], None] | None) -> None:
        self.writer.items_ended = told

    # -----------------------------------------------------------------------------------------
    # Lifecycle

    async def run(self) -> None:
        """Dispatch until :meth:`stop`; then drain (grace period), requeue the rest, return."""
        state, cfg = self.state, self.state.config
        watch = self.watchers
        writer = asyncio.create_task(self.writer.write_results(), name="results")
        helpers = [
            asyncio.create_task(watch.beat_claims(), name="claim-beats"),
            asyncio.create_task(watch.beat_leases(), name="lease-beats"),
            asyncio.create_task(watch.listen_preemptions(), name="preemptions"),
            asyncio.create_task(watch.listen_claimable(self._claimable), name="work-bell"),
            asyncio.create_task(self.attempts.report_progress(), name="progress"),
        ]
        if cfg.observe_interval_s > 0:
            helpers.append(asyncio.create_task(watch.observe(), name="observe"))
        if cfg.work_budget is not None:
            helpers.append(asyncio.create_task(watch.control_budget(), name="work-budget"))
        if cfg.stall_timeout_s > 0:
            helpers.append(asyncio.create_task(watch.watch_stalls(), name="stall-watch"))
        if self.prefixes.finds_prefixes():
            helpers.append(asyncio.create_task(self.prefixes.find_prefixes(), name="prefixes"))
        if cfg.scheduler_metrics_url:
            helpers.append(asyncio.create_task(watch.watch_scheduler(), name="scheduler-watch"))
        try:
            faults = 0
            while not self._stopping.is_set():
                try:
                    started = await self._fill()
                    faults = 0
                except (StoreUnavailable, LedgerError) as exc:
                    log.warning("node %s: %s; retrying", cfg.node, exc)
                    # A back-off a wake does not cut (its own leases given back, say).
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), max(1.0, cfg.idle_poll_s))
                    continue
                except Exception:
                    # A fault of the worker's own: the node must not stop dispatching for good
                    # on it (the process would live on, feeding its engine nothing), and what
                    # is in flight must not be abandoned. Logged, backed off, tried again.
                    faults += 1
                    pause = min(FILL_FAULT_MAX_S, max(1.0, cfg.idle_poll_s) * 2**faults)
                    log.exception(
                        "node %s: claiming failed; trying again in %.0f s", cfg.node, pause
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stopping.wait(), pause)
                    continue
                if started == 0:
                    await state.sleep(cfg.idle_poll_s)
        finally:
            # However the loop ended, what is in flight is drained (requeued, leases released)
            # while the store and ledger are still open.
            await self._drain()
            # The writer commits the batch it holds before it stops: cancelled in its flush
            # pause, that batch was lost, its items left running until the reaper came.
            await self.writer.put(None)
            try:
                await asyncio.wait_for(writer, cfg.grace_s + 30)
            except TimeoutError:
                log.warning("node %s: results not written before shutdown", cfg.node)
            except Exception:
                log.exception("node %s: the result writer failed", cfg.node)
            finally:
                failed = await self._stop_helpers(helpers)
            await self.writer.flush_results()
            await state.release_leftovers()
            if failed is not None:
                raise failed

    def _claimable(self) -> None:
        """A job of this node's model became claimable: an idle claim loop claims now, and
        the prefix finder looks for the job's pass (its items wait for it)."""
        self.state.work_claimable()
        self.prefixes.look()

    async def _stop_helpers(self, helpers: list[asyncio.Task[None]]) -> BaseException | None:
        """Stop the helper tasks, cancelling again any whose cancellation was lost
        (``backfill.cancelling``: awaited after one cancel, such a loop held the stop for
        good); the first fault of one, to raise once the drain has ended. One that will not
        stop is logged and left."""
        stuck = await cancel_and_wait(helpers)
        if stuck:
            names = ", ".join(sorted(t.get_name() for t in stuck))
            log.warning("node %s: %s did not stop when cancelled", self.state.config.node, names)
        ended = [t for t in helpers if t.done() and not t.cancelled()]
        return next((e for t in ended if (e := t.exception()) is not None), None)

    def stop(self) -> None:
        """Stop claiming; in-flight items get the grace period, then are requeued."""
        self._stopping.set()
        self.state.room.set()

    async def _engine_answers(self) -> bool:
        state = self.state
        try:
            await state.engine.models()
        except (EngineError, OSError) as exc:
            log.warning("node %s: engine not answering (%s); not claiming", state.config.node, exc)
            await state.sleep(1.0)
            return False
        log.info("node %s: engine answers again; claiming", state.config.node)
        state.engine_down = False
        return True

    async def _drain(self) -> None:
        state = self.state
        deadline = time.monotonic() + state.config.grace_s
        while state.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for flight in list(state.flights.values()):
            state.cancel(flight, StopReason.SHUTDOWN)
        tasks = [f.task for f in state.flights.values() if f.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        await self.attempts.cleaned_up()

    # -----------------------------------------------------------------------------------------
    # An item's walk: claim, check, reserve, start, launch

    async def _fill(self) -> int:
        """Claim, check, reserve and start what the node has room for; returns how many items
        it started or settled (0: nothing to do now, and the caller waits)."""
        state = self.state
        cfg = state.config
        budget = state.work_budget
        view = state.view(budget)
        room = start_room(view.load, budget, cfg.max_in_flight, engine_suspect=view.engine_suspect)
        if room <= 0:
            return 0
        if state.engine_down and not await self._engine_answers():
            # Claiming now would only cycle items through claim -> requeue, each time
            # spending one of their attempts, for as long as the engine is down.
            return 0
        snap = await state.ledger.snapshot(cfg.node)
        if snap is None or not snap.ready:
            return 0
        # Woken when a lease ends, a prefill ends (first token) or an item finishes.
        want = claim_size(state.view(budget), room, cfg.claim_batch, snap.slack, state.block_size)
        if want == 0:
            return 0
        if state.engine_down:
            return 0  # a stream broke while the snapshot was read: the engine may be gone
        claiming = time.monotonic()
        # Only work for the model this node's engine serves: a line's result must come from
        # the model it names. The claim's items stay locked, unwritten, until its start.
        claim = await asyncio.to_thread(
            state.repo.claims.open_claim,
            cfg.node,
            want,
            cfg.lease_ttl_s,
            models=[state.model],
            prefix_hold_s=prefix_claim_hold_s(
                self.prefixes.finds_prefixes(), cfg.prefix_pass_hold_s
            ),
        )
        if not claim.items:
            self.prefixes.look()
            return 0
        try:
            state.stats.claimed += len(claim.items)
            ready, refused = await self.checker.check(claim.items, claiming)
            leased = await self._reserve(claim, ready, refused)
            started = await self._start_claim(claim, leased, refused)
            state.stats.started += started
            return started + len(refused)
        finally:
            if claim.open:
                # Ended before its start (a fault, a cancellation): nothing was written, the
                # items unlock as they were.
                with contextlib.suppress(StoreUnavailable):
                    await asyncio.to_thread(state.repo.claims.drop_claim, claim)

    async def _reserve(
        self, claim: OpenClaim, ready: list[CheckedItem], refused: list[Refused]
    ) -> dict[int, Leased]:
        """Reserve leases for what the slack takes; what it does not take is added to
        ``refused`` (held and settled at the start) or left in the queue untouched (no write,
        no attempt spent). When the ledger does not answer, the claim starts with the refused
        alone and the error is raised."""
        state = self.state
        cfg = state.config
        # Those of a shared prefix whose first holder is still prefilling wait in the queue
        # (untouched), to lean on the prefix once it is cached.
        prefixed = plan_prefix_starts(
            ready, state.block_size, state.prefix_view(), wait_s=cfg.first_prefill_wait_s
        )
        state.stats.prefix_waits += len(prefixed.waiting)
        plan = await self._fit_to_slack(prefixed)
        fits = list(plan.fits)
        leased: dict[int, Leased] = {}
        if not fits:
            return leased
        requests = [
            reserve_request(
                c,
                cfg.node,
                max_preemptions=cfg.max_preemptions,
                lease_ttl_s=cfg.lease_ttl_s,
                prefix_tokens=share,
            )
            for c, share in zip(fits, prefixed.shares, strict=False)
        ]
        try:
            outcomes: list[Lease | Denial | BaseException] = list(
                await state.ledger.reserve_many(requests)
            )
        except PartialBatchError as exc:
            # Each reservation is its own atomic call: keep the admitted ones, give the
            # others back below.
            outcomes = list(exc.results)  # type: ignore[arg-type]
            await state.release_unconfirmed(
                [r for r, o in zip(requests, outcomes, strict=True) if isinstance(o, Exception)]
            )
        except (LedgerError, LedgerUnavailable):
            # No answer: what fits stays in the queue as it was, and what Redis may have
            # granted (a reply lost with its connection) is given back; the refused are
            # settled all the same.
            await state.release_unconfirmed(requests)
            await self._start_claim(claim, {}, refused)
            raise
        for at, (checked, outcome) in enumerate(zip(fits, outcomes, strict=True)):
            item = checked.item
            verdict = after_reserve(outcome)
            if isinstance(verdict, Lease):
                state.leases[verdict.lease_id] = verdict
                state.typical_reservation = running_mean(state.typical_reservation, verdict.tokens)
                leased[item.id] = Leased(checked, verdict, prefixed.cached[at])
                continue
            if isinstance(outcome, BaseException):
                log.warning("node %s: reserve failed for item %s: %s", cfg.node, item.id, outcome)
            refused.append((item, verdict))
        return leased

    async def _fit_to_slack(self, prefixed: PrefixStarts) -> StartPlan:
        """What of ``prefixed.starting`` the node's slack and work budget take now, and what
        goes back to the queue at once (``backfill.dispatch.fit_starts``; no deferral churn)."""
        state = self.state
        snap = await state.ledger.snapshot(state.config.node)
        slack = 0 if snap is None else snap.slack
        held = frozenset(p.prefix_id for p in snap.prefixes) if snap is not None else frozenset()
        return fit_starts(
            prefixed.starting,
            state.view(),
            slack,
            state.block_size,
            shares=prefixed.shares,
            held_prefixes=held,
            cached=prefixed.cached,
        )

    async def _start_claim(
        self, claim: OpenClaim, leased: dict[int, Leased], refused: list[Refused]
    ) -> int:
        """Start ``claim`` (one write: the leased items run, the refused are held), launch
        what started, then settle the refused; returns how many started."""
        state = self.state
        starts = [x.start() for x in leased.values()]
        held = [(item.id, item.attempt) for item, _ in refused]
        sent = time.monotonic()
        try:
            applied = set(
                await asyncio.to_thread(state.repo.claims.start_claim, claim, starts, held)
            )
        except StoreUnavailable:
            # Landed or not, nothing of this start is launched: its leases go back to the
            # slack now, not when their TTL runs out (a start that did land is never beaten
            # in Postgres either, and the reaper requeues it when its lease lapses there).
            await state.release_leases([x.lease for x in leased.values()])
            raise
        # Those whose job was cancelled while the claim was open.
        await state.release_leases([x.lease for i, x in leased.items() if i not in applied])
        for item_id in applied:
            self._launch(leased[item_id], claim_extended_at=sent)
        for item, outcome in refused:
            await self.checker.settle(item, outcome)
        return len(applied)

    def _launch(self, leased: Leased, *, claim_extended_at: float) -> None:
        """Register a started attempt and hand it to ``attempts`` to stream (or, preempted
        already, stop it at once); its end goes to ``writer``, which releases its lease."""
        state = self.state
        checked, lease = leased.checked, leased.lease
        item, run = checked.item, checked.run
        flight = Flight(
            item=item,
            lease=lease,
            endpoint=item.endpoint,
            run=run,
            prompt_tokens=checked.prompt_tokens,
            # What the engine computes: a prefix cached here is not prefilled again.
            prefill_tokens=leased.prefill,
            # Progress of earlier attempts is this one's from the start: a preemption before
            # its first token must keep it, not store zero.
            generated=run.kept,
            text={0: [item.partial_output]} if run.kept and item.partial_output else {},
            claim_extended_at=claim_extended_at,
        )
        state.flights[item.id] = flight
        state.by_lease[lease.lease_id] = item.id
        state.typical_prompt = running_mean(state.typical_prompt, leased.prefill)
        state.event(
            logging.DEBUG,
            flight,
            "start",
            "item %s attempt %s started on %s reserved tokens",
            item.id,
            item.attempt,
            lease.tokens,
        )
        attempts = self.attempts
        if state.early_preemptions.pop(lease.lease_id, None) is not None:
            # Preempted before it started: keep its progress, requeue it, no engine work.
            flight.stop_reason = StopReason.PREEMPTED
            flight.task = asyncio.create_task(attempts.stopped(flight), name=f"item-{item.id}")
            return
        flight.task = asyncio.create_task(attempts.generate(flight), name=f"item-{item.id}")
        flight.task.add_done_callback(functools.partial(attempts.cancelled_early, flight=flight))
