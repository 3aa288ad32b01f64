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
``backfill.dispatch``, pure functions over a view of the dispatcher (``NodeDispatcher.view``);
the loop gathers the view, asks them, and carries the answers out: engine calls, Postgres and
ledger writes. This module claims, checks and starts; ``worker.dispatch_attempts`` runs the
attempts, ``worker.dispatch_results`` writes their results, ``worker.dispatch_watch`` watches
leases, the engine and the work budget, and ``worker.dispatch_state`` holds what they share.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

from backfill.dispatch import (
    CheckedItem,
    DispatchConfig,
    EngineAbsent,
    Expire,
    Fail,
    GiveBack,
    Leased,
    Limits,
    PrefixStarts,
    StartPlan,
    StopReason,
    after_reserve,
    claim_size,
    fit_output,
    fit_starts,
    judge,
    over_limit,
    plan_prefix_starts,
    prefix_claim_hold_s,
    reserve_request,
    run_output,
    running_mean,
    start_room,
)
from backfill.engine.protocol import EngineError, count_prefill
from backfill.errors import LedgerError, LedgerUnavailable, StaleWrite, StoreUnavailable
from backfill.ledger import Denial, Lease, PartialBatchError, ReserveRequest
from backfill.prefill import PromptCount, prefill_plan
from backfill.states import ItemState
from backfill.store import ClaimedItem, OpenClaim
from worker.dispatch_attempts import AttemptRunner
from worker.dispatch_prefixes import PrefixFinding
from worker.dispatch_results import ResultWriter
from worker.dispatch_state import DispatchStats, Flight
from worker.dispatch_watch import Watchers
from worker.prepare import run_plan

__all__ = ["DispatchConfig", "DispatchStats", "NodeDispatcher"]

log = logging.getLogger("backfill.worker")

Refused = tuple[ClaimedItem, GiveBack | Fail | Expire]
"""A claimed item that does not start, and what becomes of it."""

# The longest pause after a claim that failed on a fault of the worker's own (it doubles from
# a second with each failure in a row).
FILL_FAULT_MAX_S = 30.0


class NodeDispatcher(AttemptRunner, ResultWriter, Watchers, PrefixFinding):
    """Runs the claim -> reserve -> start -> stream -> finish loop for one node."""

    # -----------------------------------------------------------------------------------------
    # Lifecycle

    async def run(self) -> None:
        """Dispatch until :meth:`stop`; then drain (grace period), requeue the rest, return."""
        writer = asyncio.create_task(self._write_results(), name="results")
        helpers = [
            asyncio.create_task(self._beat_claims(), name="claim-beats"),
            asyncio.create_task(self._beat_leases(), name="lease-beats"),
            asyncio.create_task(self._listen_preemptions(), name="preemptions"),
            asyncio.create_task(self._report_progress(), name="progress"),
        ]
        if self.config.observe_interval_s > 0:
            helpers.append(asyncio.create_task(self._observe(), name="observe"))
        if self.config.work_budget is not None:
            helpers.append(asyncio.create_task(self._control_budget(), name="work-budget"))
        if self.config.stall_timeout_s > 0:
            helpers.append(asyncio.create_task(self._watch_stalls(), name="stall-watch"))
        if self.finds_prefixes():
            helpers.append(asyncio.create_task(self._find_prefixes(), name="prefixes"))
        if self.config.scheduler_metrics_url:
            helpers.append(asyncio.create_task(self._watch_scheduler(), name="scheduler-watch"))
        try:
            faults = 0
            while not self.stopping.is_set():
                try:
                    started = await self._fill()
                    faults = 0
                except (StoreUnavailable, LedgerError) as exc:
                    log.warning("node %s: %s; retrying", self.config.node, exc)
                    await self.sleep(max(1.0, self.config.idle_poll_s))
                    continue
                except Exception:
                    # A fault of the worker's own: the node must not stop dispatching for good
                    # on it (the process would live on, feeding its engine nothing), and what
                    # is in flight must not be abandoned. Logged, backed off, tried again.
                    faults += 1
                    pause = min(FILL_FAULT_MAX_S, max(1.0, self.config.idle_poll_s) * 2**faults)
                    log.exception(
                        "node %s: claiming failed; trying again in %.0f s", self.config.node, pause
                    )
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stopping.wait(), pause)
                    continue
                if started == 0:
                    await self.sleep(self.config.idle_poll_s)
        finally:
            # However the loop ended, what is in flight is drained (requeued, leases released)
            # while the store and ledger are still open.
            await self._drain()
            # The writer commits the batch it holds before it stops: cancelled in its flush
            # pause, that batch was lost, its items left running until the reaper came.
            await self.results.put(None)
            try:
                await asyncio.wait_for(writer, self.config.grace_s + 30)
            except TimeoutError:
                log.warning("node %s: results not written before shutdown", self.config.node)
            except Exception:
                log.exception("node %s: the result writer failed", self.config.node)
            finally:
                for task in helpers:
                    task.cancel()
                for task in helpers:
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            await self._flush_results()
            await self.release_leftovers()

    def stop(self) -> None:
        """Stop claiming; in-flight items get the grace period, then are requeued."""
        self.stopping.set()
        self.room.set()

    async def _engine_answers(self) -> bool:
        try:
            await self.engine.models()
        except (EngineError, OSError) as exc:
            log.warning("node %s: engine not answering (%s); not claiming", self.config.node, exc)
            await self.sleep(1.0)
            return False
        log.info("node %s: engine answers again; claiming", self.config.node)
        self.engine_down = False
        return True

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.grace_s
        while self.flights and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for flight in list(self.flights.values()):
            self.cancel(flight, StopReason.SHUTDOWN)
        tasks = [f.task for f in self.flights.values() if f.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        while self.cleanups:
            await asyncio.gather(*list(self.cleanups), return_exceptions=True)

    # -----------------------------------------------------------------------------------------
    # Claim, tokenize, check, reserve, start

    async def _fill(self) -> int:
        """Claim, check, reserve and start what the node has room for; returns how many items
        it started or settled (0: nothing to do now, and the caller waits)."""
        cfg = self.config
        budget = self.work_budget
        view = self.view(budget)
        room = start_room(view.load, budget, cfg.max_in_flight, engine_suspect=view.engine_suspect)
        if room <= 0:
            return 0
        if self.engine_down and not await self._engine_answers():
            # Claiming now would only cycle items through claim -> requeue, each time
            # spending one of their attempts, for as long as the engine is down.
            return 0
        snap = await self.ledger.snapshot(cfg.node)
        if snap is None or not snap.ready:
            return 0
        # Woken when a lease ends, a prefill ends (first token) or an item finishes.
        want = claim_size(self.view(budget), room, cfg.claim_batch, snap.slack, self.block_size)
        if want == 0:
            return 0
        if self.engine_down:
            return 0  # a stream broke while the snapshot was read: the engine may be gone
        claiming = time.monotonic()
        # Only work for the model this node's engine serves: a line's result must come from
        # the model it names. The claim's items stay locked, unwritten, until its start.
        claim = await asyncio.to_thread(
            self.repo.open_claim,
            cfg.node,
            want,
            cfg.lease_ttl_s,
            models=[self.model],
            prefix_hold_s=prefix_claim_hold_s(self.finds_prefixes(), cfg.prefix_pass_hold_s),
        )
        if not claim.items:
            self.prefix_look.set()
            return 0
        try:
            self.stats.claimed += len(claim.items)
            ready, refused = await self._check(claim.items, claiming)
            return await self._reserve_and_start(claim, ready, refused)
        finally:
            if claim.open:
                # Ended before its start (a fault, a cancellation): nothing was written, the
                # items unlock as they were.
                with contextlib.suppress(StoreUnavailable):
                    await asyncio.to_thread(self.repo.drop_claim, claim)

    async def _check(
        self, claimed: list[ClaimedItem], claiming: float | None = None
    ) -> tuple[list[CheckedItem], list[Refused]]:
        """Exact prompt tokens of what each item will run, class limit and deadline, before
        any engine work: the items ready to reserve, and those refused with what becomes of
        each (settled after the claim's start: their rows are locked until then). Deadlines
        are judged on Postgres' clock: the time left at the claim (asked at ``claiming``,
        monotonic; now if not given) less the time counting took."""
        if claiming is None:
            claiming = time.monotonic()
        counted = await asyncio.gather(*(self._prepare(c) for c in claimed), return_exceptions=True)
        limits = Limits(
            max_sequence_tokens=self.max_sequence_tokens,
            max_attempts=self.config.max_attempts,
            prefill_tokens_per_s=self.config.prefill_tokens_per_s,
            decode_tokens_per_s=self.decode_rate,
        )
        ready: list[CheckedItem] = []
        refused: list[Refused] = []
        for item, outcome in zip(claimed, counted, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            left_s = item.deadline_left_s - (time.monotonic() - claiming)
            verdict = judge(item, outcome, limits, left_s)
            if isinstance(verdict, CheckedItem):
                ready.append(verdict)
            elif isinstance(verdict, EngineAbsent):
                self.engine_down = True
                refused.append((item, verdict.give_back))
            else:
                refused.append((item, verdict))
        return ready, refused

    async def _prepare(self, item: ClaimedItem) -> CheckedItem:
        """Decide what ``item`` runs and count it exactly; a line that gave no output budget
        gets what the class limit leaves the count (``fit_output``). A continuation the class
        limit would refuse (its re-tokenized partial output came out longer) runs from the
        start."""
        limit = self.max_sequence_tokens
        run = run_plan(item)
        original = None if run.kept else await self._count_original(item, run.request)
        count = original or await self._count(run.request, item.endpoint)
        run = fit_output(item, run, count, limit)
        if run.kept and not run.complete:
            fitted = run.max_output is not None
            if over_limit(count, run_output(item, run), limit, fitted=fitted) is not None:
                run = run_plan(item, from_start=True)
                original = count = await self._count_original(item, run.request)
                run = fit_output(item, run, count, limit)
        prompt_tokens = (
            original.total
            if original is not None
            else item.prompt_tokens or max(count.total - run.kept, 0)
        )
        return CheckedItem(item, run, count, prompt_tokens)

    async def _count_original(self, item: ClaimedItem, body: dict[str, Any]) -> PromptCount:
        """The count of an item's own request: stored by an earlier attempt (one sequence)
        or remembered from an earlier claim, else asked of the engine."""
        known = self.counted.get(item.id)
        if known is not None:
            return known
        # Postgres keeps one number, which is the whole count only for one sequence.
        if item.prompt_tokens is not None and prefill_plan(item.endpoint, body).sequences == 1:
            count = PromptCount.single(item.prompt_tokens)
        else:
            count = await self._count(body, item.endpoint)
        self.remember_count(item.id, count)
        return count

    async def _count(self, body: dict[str, Any], endpoint: str) -> PromptCount:
        plan = prefill_plan(endpoint, body)
        async with self.tokenize_slots:
            return await count_prefill(self.engine, plan, self.model or str(body.get("model")))

    async def _reserve_and_start(
        self, claim: OpenClaim, ready: list[CheckedItem], refused: list[Refused]
    ) -> int:
        """Reserve leases for what the slack takes, then start the claim: the leased items
        run, the refused are held and settled, the rest is left in the queue untouched (no
        write, no attempt spent). Returns how many items started or were settled."""
        cfg = self.config
        # Those of a shared prefix whose first holder is still prefilling wait in the queue
        # (untouched), to lean on the prefix once it is cached.
        prefixed = plan_prefix_starts(
            ready, self.block_size, self.prefix_view(), wait_s=cfg.first_prefill_wait_s
        )
        self.stats.prefix_waits += len(prefixed.waiting)
        plan = await self._fit_to_slack(prefixed)
        fits = list(plan.fits)
        leased: dict[int, Leased] = {}
        if fits:
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
                    await self.ledger.reserve_many(requests)
                )
            except PartialBatchError as exc:
                # Each reservation is its own atomic call: keep the admitted ones, give the
                # others back below.
                outcomes = list(exc.results)  # type: ignore[arg-type]
                await self._release_unconfirmed(
                    [r for r, o in zip(requests, outcomes, strict=True) if isinstance(o, Exception)]
                )
            except (LedgerError, LedgerUnavailable):
                # No answer: what fits stays in the queue as it was, and what Redis may have
                # granted (a reply lost with its connection) is given back; the refused are
                # settled all the same.
                await self._release_unconfirmed(requests)
                await self._start_claim(claim, {}, refused)
                raise
            for at, (checked, outcome) in enumerate(zip(fits, outcomes, strict=True)):
                item = checked.item
                verdict = after_reserve(outcome)
                if isinstance(verdict, Lease):
                    self.leases[verdict.lease_id] = verdict
                    self.typical_reservation = running_mean(
                        self.typical_reservation, verdict.tokens
                    )
                    leased[item.id] = Leased(checked, verdict, prefixed.cached[at])
                    continue
                if isinstance(outcome, BaseException):
                    log.warning(
                        "node %s: reserve failed for item %s: %s", cfg.node, item.id, outcome
                    )
                refused.append((item, verdict))
        started = await self._start_claim(claim, leased, refused)
        self.stats.started += started
        return started + len(refused)

    async def _release_unconfirmed(self, requests: list[ReserveRequest]) -> None:
        """Give back reservations whose answer was lost (their call failed on its connection:
        Redis may have granted them), so they do not hold the slack until their TTL runs out.
        Best effort: a ledger still out of reach leaves them to the TTL, as before."""
        if not requests:
            return
        try:
            await self.ledger.release_unconfirmed(requests)
        except (LedgerError, LedgerUnavailable) as exc:
            log.warning(
                "node %s: %d reservations of unknown outcome left to their TTL: %s",
                self.config.node,
                len(requests),
                exc,
            )

    async def _start_claim(
        self, claim: OpenClaim, leased: dict[int, Leased], refused: list[Refused]
    ) -> int:
        """Start ``claim`` (one write: the leased items run, the refused are held), launch
        what started, then settle the refused; returns how many started."""
        starts = [x.start() for x in leased.values()]
        held = [(item.id, item.attempt) for item, _ in refused]
        sent = time.monotonic()
        try:
            applied = set(await asyncio.to_thread(self.repo.start_claim, claim, starts, held))
        except StoreUnavailable:
            # Landed or not, nothing of this start is launched: its leases go back to the
            # slack now, not when their TTL runs out (a start that did land is never beaten
            # in Postgres either, and the reaper requeues it when its lease lapses there).
            await self.release_leases([x.lease for x in leased.values()])
            raise
        # Those whose job was cancelled while the claim was open.
        await self.release_leases([x.lease for i, x in leased.items() if i not in applied])
        for item_id in applied:
            self._launch(leased[item_id], claim_extended_at=sent)
        for item, outcome in refused:
            await self._settle_claimed(item, outcome)
        return len(applied)

    def _launch(self, leased: Leased, *, claim_extended_at: float) -> None:
        """Register a started attempt and run it (or, preempted already, stop it at once)."""
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
        self.flights[item.id] = flight
        self.by_lease[lease.lease_id] = item.id
        self.typical_prompt = running_mean(self.typical_prompt, leased.prefill)
        self.event(
            logging.DEBUG,
            flight,
            "start",
            "item %s attempt %s started on %s reserved tokens",
            item.id,
            item.attempt,
            lease.tokens,
        )
        if self.early_preemptions.pop(lease.lease_id, None) is not None:
            # Preempted before it started: keep its progress, requeue it, no engine work.
            flight.stop_reason = StopReason.PREEMPTED
            flight.task = asyncio.create_task(self._stopped(flight), name=f"item-{item.id}")
            return
        flight.task = asyncio.create_task(self._generate(flight), name=f"item-{item.id}")
        flight.task.add_done_callback(functools.partial(self._cancelled_early, flight=flight))

    async def _fit_to_slack(self, prefixed: PrefixStarts) -> StartPlan:
        """What of ``prefixed.starting`` the node's slack and work budget take now, and what
        goes back to the queue at once (``backfill.dispatch.fit_starts``; no deferral churn)."""
        snap = await self.ledger.snapshot(self.config.node)
        slack = 0 if snap is None else snap.slack
        held = frozenset(p.prefix_id for p in snap.prefixes) if snap is not None else frozenset()
        return fit_starts(
            prefixed.starting,
            self.view(),
            slack,
            self.block_size,
            shares=prefixed.shares,
            held_prefixes=held,
            cached=prefixed.cached,
        )

    async def _settle_claimed(self, item: ClaimedItem, outcome: GiveBack | Fail | Expire) -> None:
        """Write what becomes of a claimed item that does not start (fenced by its attempt:
        nothing to do if its claim moved on meanwhile)."""
        if isinstance(outcome, Expire):
            with contextlib.suppress(StaleWrite):
                await asyncio.to_thread(
                    self.repo.expire_claimed, item.id, item.attempt, outcome.reason
                )
            self.stats.expired += 1
            return
        if isinstance(outcome, Fail):
            with contextlib.suppress(StaleWrite):
                await asyncio.to_thread(self.repo.fail, item.id, item.attempt, outcome.error)
            self.stats.failed += 1
            return
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(
                self.repo.give_back,
                item.id,
                item.attempt,
                outcome.state,
                retry_after_s=outcome.retry_after_s or None,
                detail=outcome.detail,
            )
        if outcome.state is ItemState.DEFERRED:
            self.stats.deferred += 1
