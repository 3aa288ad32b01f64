"""The node dispatcher: feeds one engine from its batch slack, in deadline order.

One asyncio loop per GPU node, beside its vLLM server:

1. claim a batch of items from Postgres (earliest deadline first, ``SKIP LOCKED``), never
   more than the slack could admit;
2. count each prompt's tokens with the engine's own tokenizer; refuse what breaks the batch
   class limit, and expire what cannot finish before its deadline (before any prefill);
3. reserve ``prompt + max_output`` (block-rounded) per item from the node's batch slack in the
   ledger — one pipelined round trip; items that do not fit are deferred, not started;
4. mark the leased items running (fenced by attempt and fencing token), then stream each from
   the engine with the batch priority;
5. write results in batches and release each lease after its result is durable.

Interactive load takes precedence in two ways: it shrinks the slack (fewer new items), and the
ledger preempts running batch leases, which reaches this loop as a pub/sub notice (or, if the
notice is lost, as the lease's heartbeat status). A preempted item is aborted in the engine
(closing its stream frees its KV blocks), keeps its partial output, and resumes later from it.

What to claim, check, start, stop, retry or fail is decided by the plans of
``backfill.dispatch``, pure functions over a view of this dispatcher (:meth:`NodeDispatcher.view`);
this module gathers the view, asks them, and carries the answers out: engine calls, Postgres and
ledger writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from backfill.clock import HostClock, SharedClock, redis_time
from backfill.dispatch import (
    CheckedItem,
    DispatchConfig,
    EngineAbsent,
    Expire,
    Fail,
    FailureKind,
    FlightView,
    GiveBack,
    Leased,
    Limits,
    NodeView,
    StopAction,
    StopReason,
    after_reserve,
    after_stop,
    budget_opened,
    budget_signals,
    claim_size,
    engine_refusal,
    fit_starts,
    heartbeat_stop,
    judge,
    over_limit,
    reserve_request,
    retry_or_fail,
    running_mean,
    stalled,
    start_room,
    ttft_victims,
)
from backfill.engine.http import read_engine_scheduler
from backfill.engine.protocol import (
    Endpoint,
    Engine,
    EngineError,
    EngineRejected,
    EngineUnavailable,
    count_prefill,
)
from backfill.engine_scheduler import EngineScheduler, publish_scheduler
from backfill.errors import (
    BackfillError,
    LedgerError,
    LedgerUnavailable,
    StaleWrite,
    StoreUnavailable,
)
from backfill.ledger import AsyncLedger, Denial, Lease, PartialBatchError
from backfill.observe import observed_non_batch
from backfill.prefill import PromptCount, prefill_plan
from backfill.states import ItemState
from backfill.store import ClaimedItem, Finish, Repository
from backfill.work_budget import (
    WorkBudget,
    describe,
    step,
)
from backfill.work_signals import (
    BudgetView,
    InteractiveSignals,
    exchange_batch_awaiting,
    publish_budget,
    read_signals,
)
from worker.prepare import RunPlan, run_plan
from worker.response import ResponseAssembler

__all__ = ["DispatchConfig", "DispatchStats", "NodeDispatcher"]

log = logging.getLogger("backfill.worker")

# The result writer's waits between tries while Postgres is out of reach (doubling).
RESULT_RETRY_FIRST_S = 0.5
RESULT_RETRY_MAX_S = 10.0
# Prompt token counts the dispatcher remembers (item id -> tokens), so an item given back
# unstarted is not counted again when it is claimed again.
_COUNTED_KEPT = 65_536


@dataclass
class _InFlight:
    item: ClaimedItem
    lease: Lease
    endpoint: str
    run: RunPlan
    prompt_tokens: int = 0
    """The original prompt's tokens: with ``generated``, what the sequence holds in the engine."""
    prefill_tokens: int = 0
    """What this run prefills (a continuation's prompt holds its partial output), for every
    sequence it creates."""
    task: asyncio.Task[None] | None = None
    generated: int = 0
    settled: int = 0
    """``generated`` as last reported to the ledger (``_report_progress``)."""
    text: dict[int, list[str]] = field(default_factory=dict)
    answer: ResponseAssembler | None = None
    """This attempt's stream, folded into the non-streaming body as it arrives."""
    stop_reason: StopReason | None = None
    """Why the dispatcher cancelled it."""
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    """Until its first token the item is in prefill: it counts against the work budget's
    prefill tokens."""
    last_chunk_at: float = field(default_factory=time.monotonic)
    """When the engine last sent anything for it (the stall watch's clock)."""

    def view(self) -> FlightView:
        """This attempt as the plans see it."""
        lease = self.lease
        return FlightView(
            item_id=self.item.id,
            attempt=self.item.attempt,
            lease_id=lease.lease_id,
            tokens=lease.tokens,
            deadline_ms=lease.deadline_ms,
            preemptible=lease.preemptible,
            prompt_tokens=self.prompt_tokens,
            prefill_tokens=self.prefill_tokens,
            generated=self.generated,
            kept=self.run.kept,
            started_s=self.started,
            first_token_at=self.first_token_at,
            last_chunk_at=self.last_chunk_at,
            stopping=self.stop_reason is not None,
            generating=self.task is not None and not self.task.done(),
        )


@dataclass
class DispatchStats:
    """What this dispatcher has done (printed by ``backfill worker``, read by tests)."""

    claimed: int = 0
    started: int = 0
    succeeded: int = 0
    failed: int = 0
    deferred: int = 0
    expired: int = 0
    preempted: int = 0
    requeued: int = 0
    stale_results: int = 0
    output_tokens: int = 0
    budget_preemptions: int = 0
    """Items the work budget preempted to protect an interactive TTFT target."""
    reservation_violations: int = 0
    """Attempts the engine says held more KV than their lease (must stay 0)."""
    stalls: int = 0
    """Attempts stopped because their engine made no progress at all for the stall timeout."""


class NodeDispatcher:
    """Runs the claim -> reserve -> start -> stream -> finish loop for one node."""

    def __init__(
        self,
        config: DispatchConfig,
        engine: Engine,
        repo: Repository,
        ledger: AsyncLedger,
        *,
        model: str,
        block_size: int,
        max_sequence_tokens: int,
        host_clock: HostClock = time.time,
    ) -> None:
        self.config = config
        # Redis' clock, read here: the gateways' signal stamps and the published budgets are
        # compared on it (this host's clock may be off; ``host_clock`` is it).
        self.clock = SharedClock(host=host_clock)
        self.engine = engine
        self.repo = repo
        self.ledger = ledger
        self.model = model
        self.block_size = block_size
        self.max_sequence_tokens = max_sequence_tokens
        self.stats = DispatchStats()
        self._in_flight: dict[int, _InFlight] = {}
        self._by_lease: dict[str, int] = {}
        # Preemption notices for leases this dispatcher does not know yet: a lease preempted
        # between its reservation and the item's registration (the notice comes while the
        # start is written to Postgres; the ledger prefers exactly those newest leases as
        # victims). Checked at registration so that such an item never reaches the engine.
        self._early_preemptions: dict[str, float] = {}
        self._worker_id = uuid.uuid4().hex
        # None is the writer's signal to commit what it holds and stop.
        self._results: asyncio.Queue[tuple[Finish, _InFlight] | None] = asyncio.Queue()
        self._stopping = asyncio.Event()
        self._room = asyncio.Event()
        self._typical_reservation = 0
        self._typical_prompt = 0
        # Prompt token counts by item id: an item given back unstarted (no slack, work budget
        # full) is not counted again by the engine when it is claimed again. Bodies never
        # change, so a count stays right; bounded, oldest forgotten first.
        self._counted: OrderedDict[int, PromptCount] = OrderedDict()
        self._cleanups: set[asyncio.Task[None]] = set()
        self._decode_rate = config.decode_tokens_per_s
        self._tokenize_slots = asyncio.Semaphore(config.tokenize_concurrency)
        # Set when the engine stopped answering; cleared once it answers again.
        self._engine_down = False
        # Set when an attempt stalled on an engine that answers but makes no progress (hung):
        # one item at a time is sent until one gets output again, so a hang spends the
        # attempts of one item per stall timeout, not of every item the node could hold.
        self._engine_suspect = False
        # What the engine's step scheduler last said of itself; None: it runs none (or its
        # metrics do not answer), and the work budget protects interactive alone.
        self.engine_scheduler: EngineScheduler | None = None
        policy = config.work_budget
        self.work_budget: WorkBudget | None = (
            None if policy is None else WorkBudget.initial(policy, self.clock.now())
        )

    # -----------------------------------------------------------------------------------------
    # Lifecycle

    async def run(self) -> None:
        """Dispatch until :meth:`stop`; then drain (grace period), requeue the rest, return."""
        writer = asyncio.create_task(self._write_results(), name="results")
        helpers = [
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._listen_preemptions(), name="preemptions"),
            asyncio.create_task(self._report_progress(), name="progress"),
        ]
        if self.config.observe_interval_s > 0:
            helpers.append(asyncio.create_task(self._observe(), name="observe"))
        if self.config.work_budget is not None:
            helpers.append(asyncio.create_task(self._control_budget(), name="work-budget"))
        if self.config.stall_timeout_s > 0:
            helpers.append(asyncio.create_task(self._watch_stalls(), name="stall-watch"))
        if self.config.scheduler_metrics_url:
            helpers.append(asyncio.create_task(self._watch_scheduler(), name="scheduler-watch"))
        try:
            while not self._stopping.is_set():
                try:
                    started = await self._fill()
                except (StoreUnavailable, LedgerError) as exc:
                    log.warning("node %s: %s; retrying", self.config.node, exc)
                    started = 0
                    await self._sleep(max(1.0, self.config.idle_poll_s))
                    continue
                if started == 0:
                    await self._sleep(self.config.idle_poll_s)
            await self._drain()
        finally:
            # The writer commits the batch it holds before it stops: cancelled in its flush
            # pause, that batch was lost, its items left running until the reaper came.
            await self._results.put(None)
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

    def stop(self) -> None:
        """Stop claiming; in-flight items get the grace period, then are requeued."""
        self._stopping.set()
        self._room.set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def view(self, budget: WorkBudget | None = None) -> NodeView:
        """What the plans know of this dispatcher now (``budget``: the work budget to judge
        by, if not the current one)."""
        return NodeView(
            flights=tuple(f.view() for f in self._in_flight.values()),
            budget=self.work_budget if budget is None else budget,
            engine_suspect=self._engine_suspect,
            typical_reservation=self._typical_reservation,
            typical_prompt=self._typical_prompt,
        )

    def _flights(self, views: Iterable[FlightView]) -> list[_InFlight]:
        """The attempts ``views`` show, those still held."""
        held = ((v, self._in_flight.get(v.item_id)) for v in views)
        return [f for v, f in held if f is not None and f.lease.lease_id == v.lease_id]

    async def _engine_answers(self) -> bool:
        try:
            await self.engine.models()
        except (EngineError, OSError) as exc:
            log.warning("node %s: engine not answering (%s); not claiming", self.config.node, exc)
            await self._sleep(1.0)
            return False
        log.info("node %s: engine answers again; claiming", self.config.node)
        self._engine_down = False
        return True

    async def _sleep(self, seconds: float) -> None:
        self._room.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._room.wait(), seconds)

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.grace_s
        while self._in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for flight in list(self._in_flight.values()):
            self._cancel(flight, StopReason.SHUTDOWN)
        tasks = [f.task for f in self._in_flight.values() if f.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        while self._cleanups:
            await asyncio.gather(*list(self._cleanups), return_exceptions=True)

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
        if self._engine_down and not await self._engine_answers():
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
        if self._engine_down:
            return 0  # a stream broke while the snapshot was read: the engine may be gone
        claiming = time.monotonic()
        # Only work for the model this node's engine serves: a line's result must come from
        # the model it names.
        claimed = await asyncio.to_thread(
            self.repo.claim, cfg.node, want, cfg.lease_ttl_s, models=[self.model]
        )
        if not claimed:
            return 0
        self.stats.claimed += len(claimed)
        ready = await self._check(claimed, claiming)
        if not ready:
            # Every claimed item was settled here (failed, expired, given back to be tried
            # again): that is progress, not idleness. Sleeping an idle poll instead would let
            # a poison item at the head of the queue stall the node once per retry.
            return len(claimed)
        return await self._reserve_and_start(ready)

    async def _check(
        self, claimed: list[ClaimedItem], claiming: float | None = None
    ) -> list[CheckedItem]:
        """Exact prompt tokens of what each item will run, class limit and deadline, before
        any engine work. Deadlines are judged on Postgres' clock: the time left at the claim
        (asked at ``claiming``, monotonic; now if not given) less the time counting took."""
        if claiming is None:
            claiming = time.monotonic()
        counted = await asyncio.gather(*(self._prepare(c) for c in claimed), return_exceptions=True)
        limits = Limits(
            max_sequence_tokens=self.max_sequence_tokens,
            max_attempts=self.config.max_attempts,
            prefill_tokens_per_s=self.config.prefill_tokens_per_s,
            decode_tokens_per_s=self._decode_rate,
        )
        ready: list[CheckedItem] = []
        for item, outcome in zip(claimed, counted, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            left_s = item.deadline_left_s - (time.monotonic() - claiming)
            verdict = judge(item, outcome, limits, left_s)
            if isinstance(verdict, CheckedItem):
                ready.append(verdict)
            elif isinstance(verdict, EngineAbsent):
                self._engine_down = True
                await self._settle_claimed(item, verdict.give_back)
            elif isinstance(verdict, Expire):
                with contextlib.suppress(StaleWrite):
                    await asyncio.to_thread(
                        self.repo.expire_claimed, item.id, item.attempt, verdict.reason
                    )
                self.stats.expired += 1
            else:
                await self._settle_claimed(item, verdict)
        return ready

    async def _prepare(self, item: ClaimedItem) -> CheckedItem:
        """Decide what ``item`` runs and count it exactly. A continuation the class limit
        would refuse (its re-tokenized partial output came out longer) runs from the start."""
        run = run_plan(item)
        original = None if run.kept else await self._count_original(item, run.request)
        count = original or await self._count(run.request, item.endpoint)
        if run.kept and not run.complete:
            left = item.max_output_tokens - run.kept
            if over_limit(count, left, self.max_sequence_tokens) is not None:
                run = run_plan(item, from_start=True)
                original = count = await self._count_original(item, run.request)
        prompt_tokens = (
            original.total
            if original is not None
            else item.prompt_tokens or max(count.total - run.kept, 0)
        )
        return CheckedItem(item, run, count, prompt_tokens)

    async def _count_original(self, item: ClaimedItem, body: dict[str, Any]) -> PromptCount:
        """The count of an item's own request: stored by an earlier attempt (one sequence)
        or remembered from an earlier claim, else asked of the engine."""
        known = self._counted.get(item.id)
        if known is not None:
            return known
        # Postgres keeps one number, which is the whole count only for one sequence.
        if item.prompt_tokens is not None and prefill_plan(item.endpoint, body).sequences == 1:
            count = PromptCount.single(item.prompt_tokens)
        else:
            count = await self._count(body, item.endpoint)
        self._counted[item.id] = count
        if len(self._counted) > _COUNTED_KEPT:
            self._counted.popitem(last=False)
        return count

    async def _count(self, body: dict[str, Any], endpoint: str) -> PromptCount:
        plan = prefill_plan(endpoint, body)
        async with self._tokenize_slots:
            count = await count_prefill(self.engine, plan, self.model or str(body.get("model")))
        self._typical_prompt = running_mean(self._typical_prompt, count.total)
        return count

    async def _reserve_and_start(self, ready: list[CheckedItem]) -> int:
        cfg = self.config
        fits = await self._fit_to_slack(ready)
        if not fits:
            return 0
        requests = [
            reserve_request(
                c, cfg.node, max_preemptions=cfg.max_preemptions, lease_ttl_s=cfg.lease_ttl_s
            )
            for c in fits
        ]
        try:
            outcomes: list[Lease | Denial | BaseException] = list(
                await self.ledger.reserve_many(requests)
            )
        except PartialBatchError as exc:
            # Each reservation is its own atomic call: keep the admitted ones, give the
            # others back below.
            outcomes = list(exc.results)  # type: ignore[arg-type]
        except LedgerError:
            for c in fits:
                await self._settle_claimed(c.item, GiveBack("ledger unavailable"))
            raise
        leased: dict[int, Leased] = {}
        for checked, outcome in zip(fits, outcomes, strict=True):
            item = checked.item
            verdict = after_reserve(outcome)
            if isinstance(verdict, Lease):
                self._typical_reservation = running_mean(self._typical_reservation, verdict.tokens)
                leased[item.id] = Leased(checked, verdict)
                continue
            if isinstance(outcome, BaseException):
                log.warning("node %s: reserve failed for item %s: %s", cfg.node, item.id, outcome)
            await self._settle_claimed(item, verdict)
        if not leased:
            return 0
        starts = [x.start() for x in leased.values()]
        applied = set(await asyncio.to_thread(self.repo.start_many, starts, cfg.lease_ttl_s))
        orphans = [x.lease for i, x in leased.items() if i not in applied]
        if orphans:
            # Their claims moved on (cancelled, reaped) between claim and start.
            await self.ledger.release_many(orphans)
        for item_id in applied:
            self._launch(leased[item_id])
        self.stats.started += len(applied)
        return len(applied)

    def _launch(self, leased: Leased) -> None:
        """Register a started attempt and run it (or, preempted already, stop it at once)."""
        checked, lease = leased.checked, leased.lease
        item, run = checked.item, checked.run
        flight = _InFlight(
            item=item,
            lease=lease,
            endpoint=item.endpoint,
            run=run,
            prompt_tokens=checked.prompt_tokens,
            prefill_tokens=checked.count.total,
            # Progress of earlier attempts is this one's from the start: a preemption before
            # its first token must keep it, not store zero.
            generated=run.kept,
            text={0: [item.partial_output]} if run.kept and item.partial_output else {},
        )
        self._in_flight[item.id] = flight
        self._by_lease[lease.lease_id] = item.id
        if self._early_preemptions.pop(lease.lease_id, None) is not None:
            # Preempted before it started: keep its progress, requeue it, no engine work.
            flight.stop_reason = StopReason.PREEMPTED
            flight.task = asyncio.create_task(self._stopped(flight), name=f"item-{item.id}")
            return
        flight.task = asyncio.create_task(self._generate(flight), name=f"item-{item.id}")
        flight.task.add_done_callback(functools.partial(self._cancelled_early, flight=flight))

    async def _fit_to_slack(self, ready: list[CheckedItem]) -> list[CheckedItem]:
        """What of ``ready`` the node's slack and work budget take now
        (``backfill.dispatch.fit_starts``); the rest goes back to the queue at once, in one
        write (no deferral churn)."""
        snap = await self.ledger.snapshot(self.config.node)
        slack = 0 if snap is None else snap.slack
        plan = fit_starts(ready, self.view(), slack, self.block_size)
        if plan.rest:
            await asyncio.to_thread(
                self.repo.unclaim, [(c.item.id, c.item.attempt) for c in plan.rest], plan.detail
            )
        return list(plan.fits)

    async def _settle_claimed(self, item: ClaimedItem, outcome: GiveBack | Fail) -> None:
        """Write what becomes of a claimed item that does not start (fenced by its attempt:
        nothing to do if its claim moved on meanwhile)."""
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

    # -----------------------------------------------------------------------------------------
    # Generation

    async def _generate(self, flight: _InFlight) -> None:
        """Run one attempt. Whatever goes wrong ends the attempt: its item is finished,
        requeued or failed, its lease released, and it leaves the flight table (an item left
        running would keep its claim and lease alive through every heartbeat)."""
        try:
            await self._run(flight)
        except asyncio.CancelledError:
            await self._stopped(flight)
        except Exception as exc:
            log.exception(
                "node %s: item %s attempt %s failed in the worker",
                self.config.node,
                flight.item.id,
                flight.item.attempt,
            )
            await self._attempt_crashed(flight, exc)

    async def _run(self, flight: _InFlight) -> None:
        item = flight.item
        request_id = f"bf-{item.id}-{item.attempt}"
        if flight.run.complete:
            # Preempted after its last token: the answer is complete; nothing to run.
            response = self._response_body(flight, request_id, "length", None)
            await self._finish(flight, ItemState.SUCCEEDED, result=json.dumps(response))
            return
        # Tokens generated by earlier attempts. Their text may be empty (a detokenizer holds
        # back an incomplete UTF-8 sequence), so progress is judged by the count.
        done = flight.run.kept
        request = dict(flight.run.request)
        request["model"] = self.model
        flight.answer = ResponseAssembler(chat=flight.endpoint == Endpoint.CHAT_COMPLETIONS)
        usage_prompt: int | None = None
        completion = 0
        try:
            stream = self.engine.stream_completion(
                flight.endpoint,
                request,
                priority=self.config.batch_priority,
                request_id=request_id,
                stream_interval=self.config.stream_interval,
            )
            async with stream:
                async for chunk in stream:
                    flight.last_chunk_at = time.monotonic()
                    if self._engine_suspect and chunk.choices:
                        log.info("node %s: the engine makes progress again", self.config.node)
                        self._engine_suspect = False
                        self._room.set()
                    flight.answer.add(chunk.raw)
                    for choice in chunk.choices:
                        flight.text.setdefault(choice.index, []).append(choice.text)
                    if flight.first_token_at is None and any(c.text for c in chunk.choices):
                        flight.first_token_at = time.monotonic()
                        if self.work_budget is not None:
                            self._room.set()  # its prompt left the budget's prefill count
                    if chunk.usage is not None:
                        usage_prompt = chunk.usage.prompt_tokens
                        completion = chunk.usage.completion_tokens
                    else:
                        completion += sum(1 for c in chunk.choices if c.text)
                    flight.generated = done + completion
        except EngineRejected as exc:
            await self._finish(flight, ItemState.FAILED, error=engine_refusal(exc))
            return
        except (EngineError, OSError) as exc:
            await self._engine_trouble(flight, exc)
            return
        self._check_reservation(flight, usage_prompt, completion)
        elapsed = time.monotonic() - flight.started
        if completion and elapsed > 0:
            rate = completion / elapsed
            self._decode_rate = 0.8 * self._decode_rate + 0.2 * max(rate, 0.1)
        response = self._response_body(flight, request_id, None, usage_prompt)
        await self._finish(flight, ItemState.SUCCEEDED, result=json.dumps(response))

    def _check_reservation(
        self, flight: _InFlight, usage_prompt: int | None, completion: int
    ) -> None:
        """The invariant, checked against the engine's own counts: the tokens it prefilled
        and generated for this attempt (all its sequences) fit the lease that covered it."""
        if usage_prompt is None:
            return
        held = usage_prompt + completion
        if held > flight.lease.tokens:
            self.stats.reservation_violations += 1
            log.error(
                "node %s: item %s attempt %s held %s KV tokens in the engine (prompt %s + "
                "output %s) on a reservation of %s",
                self.config.node,
                flight.item.id,
                flight.item.attempt,
                held,
                usage_prompt,
                completion,
                flight.lease.tokens,
            )

    async def _attempt_crashed(self, flight: _InFlight, exc: BaseException) -> None:
        """An attempt broke on something of the worker's or the item's (not the engine's):
        requeue it with backoff, or fail it at the attempt cap; release and forget it."""
        item = flight.item
        outcome = retry_or_fail(item.attempt, self.config.max_attempts, FailureKind.WORKER, exc)
        try:
            if isinstance(outcome, Fail):
                with contextlib.suppress(StaleWrite):
                    await asyncio.to_thread(
                        functools.partial(
                            self.repo.fail,
                            item.id,
                            item.attempt,
                            outcome.error,
                            fencing_token=flight.lease.fencing_token,
                        )
                    )
                self.stats.failed += 1
            else:
                await self._requeue(flight, outcome)
        except Exception:
            # Postgres is out too: the claim expires and the reaper requeues the item.
            log.exception("node %s: item %s not requeued", self.config.node, item.id)
        finally:
            await self._release(flight)

    def _response_body(
        self,
        flight: _InFlight,
        request_id: str,
        finish_reason: str | None,
        usage_prompt: int | None,
    ) -> dict[str, Any]:
        """The non-streaming response the endpoint would have sent, assembled from the stream
        (``worker.response``) and, after a preemption, the partial output the earlier attempt
        produced."""
        # The engine's count where it counted the original prompt; a continuation's prompt
        # also holds the partial output, so then the original count stands.
        kept = flight.run.kept
        prompt = usage_prompt if usage_prompt is not None and not kept else flight.prompt_tokens
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": flight.generated,
            "total_tokens": prompt + flight.generated,
        }
        answer = flight.answer or ResponseAssembler(
            chat=flight.endpoint == Endpoint.CHAT_COMPLETIONS
        )
        earlier = flight.item.partial_output if kept and flight.item.partial_output else ""
        return answer.body(
            response_id=request_id,
            model=self.model,
            created=int(time.time()),
            usage=usage,
            kept={0: earlier} if earlier else None,
            finish_reason=finish_reason,
        )

    async def _report_progress(self) -> None:
        """Settle the progress of every item that grew by ``settle_every_tokens`` since its
        last report, once per ``settle_interval_s``, in one ledger round trip for the node.
        Generated-so-far lets the ledger pick victims that lose the least work."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.settle_interval_s)
            due = [
                (f, f.generated)
                for f in self._in_flight.values()
                if f.stop_reason is None and f.generated - f.settled >= cfg.settle_every_tokens
            ]
            if not due:
                continue
            with contextlib.suppress(BackfillError):
                await self.ledger.settle_many(
                    cfg.node, [(f.lease.lease_id, f.lease.fencing_token, g) for f, g in due]
                )
                for f, g in due:
                    f.settled = g

    def _partial(self, flight: _InFlight) -> str | None:
        text = "".join(flight.text.get(0, []))
        return text or None

    async def _stopped(self, flight: _InFlight) -> None:
        """The task was cancelled by the dispatcher: keep the progress where that is ours."""
        item, lease = flight.item, flight.lease
        reason = flight.stop_reason or StopReason.SHUTDOWN
        try:
            action = after_stop(reason)
            if action is StopAction.PREEMPT:
                await asyncio.to_thread(
                    self.repo.preempt,
                    item.id,
                    item.attempt,
                    lease.fencing_token,
                    partial_output=self._partial(flight),
                    partial_tokens=flight.generated,
                )
                self.stats.preempted += 1
            elif action is StopAction.REQUEUE:
                await self._requeue(flight, GiveBack(reason.value))
            elif action is StopAction.ENGINE_FAULT:
                await self._engine_trouble(
                    flight,
                    EngineUnavailable(
                        f"the stream sent nothing for {self.config.stall_timeout_s:.0f} s "
                        "while the engine made no progress"
                    ),
                )
                return
            # NOTHING (claim lost): the item was cancelled, expired or reaped.
        except StaleWrite:
            pass
        finally:
            await self._release(flight)

    async def _engine_trouble(self, flight: _InFlight, exc: BaseException) -> None:
        item = flight.item
        if isinstance(exc, EngineUnavailable):
            # Claim nothing more until the engine answers again (see _fill). Said before the
            # first await below: a claim the loop starts meanwhile would send items to a dead
            # engine and spend one of their attempts each.
            self._engine_down = True
        log.warning(
            "node %s: item %s attempt %s: engine error: %s",
            self.config.node,
            item.id,
            item.attempt,
            exc,
        )
        outcome = retry_or_fail(item.attempt, self.config.max_attempts, FailureKind.ENGINE, exc)
        if isinstance(outcome, Fail):
            await self._finish(flight, ItemState.FAILED, error=outcome.error)
            return
        try:
            await self._requeue(flight, outcome)
        finally:
            await self._release(flight)

    async def _requeue(self, flight: _InFlight, outcome: GiveBack) -> None:
        """running -> queued for ``flight``'s attempt, its progress kept (nothing to do if
        its claim moved on meanwhile)."""
        item = flight.item
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(
                functools.partial(
                    self.repo.requeue,
                    item.id,
                    item.attempt,
                    flight.lease.fencing_token,
                    partial_output=self._partial(flight),
                    partial_tokens=flight.generated,
                    detail=outcome.detail,
                    retry_after_s=outcome.retry_after_s,
                )
            )
            self.stats.requeued += 1

    async def _finish(
        self,
        flight: _InFlight,
        state: ItemState,
        *,
        result: str | None = None,
        error: str | None = None,
    ) -> None:
        item = flight.item
        fin = Finish(
            item.id,
            item.attempt,
            flight.lease.fencing_token,
            state,
            result=result,
            error=error,
            output_tokens=flight.generated,
            prompt_tokens=item.prompt_tokens,
        )
        await self._results.put((fin, flight))

    async def _release(self, flight: _InFlight) -> None:
        self._forget(flight)
        with contextlib.suppress(BackfillError):
            await self.ledger.release(flight.lease)

    def _forget(self, flight: _InFlight) -> None:
        self._in_flight.pop(flight.item.id, None)
        self._by_lease.pop(flight.lease.lease_id, None)
        self._room.set()

    def _cancelled_early(self, task: asyncio.Task[None], flight: _InFlight) -> None:
        # A task cancelled before its first step never runs its own handler: do its cleanup
        # (requeue or preempt, release) here, or its item would stay running with a lease.
        if task.cancelled() and self._in_flight.get(flight.item.id) is flight:
            cleanup = asyncio.get_running_loop().create_task(self._stopped(flight))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)

    def _cancel(self, flight: _InFlight, reason: StopReason) -> bool:
        """Stop a generating item's task for ``reason``; False when there was nothing to stop
        (already done or already being stopped)."""
        if flight.task is not None and not flight.task.done() and flight.stop_reason is None:
            flight.stop_reason = reason
            flight.task.cancel()
            return True
        return False

    # -----------------------------------------------------------------------------------------
    # Results, heartbeats, preemption notices

    async def _write_results(self) -> None:
        """Commit results in small batches; returns after the stop signal (None)."""
        while True:
            first = await self._results.get()
            if first is None:
                return
            batch = [first]
            await asyncio.sleep(self.config.result_flush_s)
            stopping = False
            while not self._results.empty() and len(batch) < 256:
                entry = self._results.get_nowait()
                if entry is None:
                    stopping = True
                    break
                batch.append(entry)
            await self._commit_results(batch)
            if stopping:
                return

    async def _flush_results(self) -> None:
        batch = []
        while not self._results.empty():
            entry = self._results.get_nowait()
            if entry is not None:
                batch.append(entry)
        if batch:
            await self._commit_results(batch)

    async def _commit_results(self, batch: list[tuple[Finish, _InFlight]]) -> None:
        wait_s = RESULT_RETRY_FIRST_S
        while True:
            try:
                applied = set(await asyncio.to_thread(self.repo.finish, [f for f, _ in batch]))
                break
            except StoreUnavailable as exc:
                # Results stay in memory (their leases held) until Postgres is back.
                log.warning(
                    "node %s: cannot write results: %s; retrying in %.1f s",
                    self.config.node,
                    exc,
                    wait_s,
                )
                await asyncio.sleep(wait_s)
                wait_s = min(wait_s * 2, RESULT_RETRY_MAX_S)
            except Exception:
                # Not the store's absence but a fault retrying will not clear. The writer must
                # live on: this batch is dropped unwritten, its items stop being heartbeated
                # and the reaper requeues them (their lost runs count against the cap).
                log.exception("node %s: results could not be written; dropped", self.config.node)
                applied = set()
                break
        for fin, flight in batch:
            if fin.item_id in applied:
                if fin.state is ItemState.SUCCEEDED:
                    self.stats.succeeded += 1
                    self.stats.output_tokens += fin.output_tokens
                else:
                    self.stats.failed += 1
            else:
                self.stats.stale_results += 1
            self._forget(flight)
        # Leases go back only once the results they produced are durable.
        with contextlib.suppress(BackfillError):
            await self.ledger.release_many([flight.lease for _, flight in batch])

    async def _heartbeat(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.heartbeat_interval_s)
            flights = list(self._in_flight.values())
            if not flights:
                continue
            try:
                held = set(
                    await asyncio.to_thread(
                        self.repo.heartbeat,
                        [(f.item.id, f.item.attempt) for f in flights],
                        cfg.lease_ttl_s,
                    )
                )
            except StoreUnavailable:
                held = {f.item.id for f in flights}
            for flight in flights:
                status = None
                if flight.item.id in held:
                    try:
                        beat = await self.ledger.heartbeat(
                            cfg.node,
                            flight.lease.lease_id,
                            flight.lease.fencing_token,
                            ttl_ms=int(cfg.lease_ttl_s * 1000),
                        )
                    except BackfillError:
                        continue
                    status = beat.status
                reason = heartbeat_stop(flight.item.id in held, status)
                if reason is not None:
                    self._cancel(flight, reason)

    async def _observe(self) -> None:
        """Tell the ledger how much of the engine's KV cache batch does not account for:
        interactive traffic that bypassed the gateway still narrows batch slack."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.observe_interval_s)
            try:
                load = await self.engine.load()
                snap = await self.ledger.snapshot(cfg.node)
                if snap is None:
                    continue
                # Output streams in chunks of ``stream_interval`` tokens: the engine may hold
                # up to ``stream_interval - 1`` more tokens of a sequence than the worker saw.
                unseen = cfg.stream_interval - 1
                in_engine = {
                    f.lease.lease_id: f.prompt_tokens + f.generated + unseen
                    for f in self._in_flight.values()
                }
                # With nothing running or waiting, no sequence holds KV: what the gauge still
                # says is free-able prefix cache, or a value from the engine's last step that
                # no step has refreshed. Trusting it could keep batch out of an idle engine,
                # and batch is what would have made the engine step again.
                idle = load.num_requests_running == 0 and load.num_requests_waiting == 0
                observed = observed_non_batch(
                    0.0 if idle else load.kv_cache_usage_perc,
                    snap.capacity_tokens,
                    snap.block_size,
                    snap.leases,
                    in_engine,
                )
                await self.ledger.observe(cfg.node, observed)
            except Exception as exc:  # a missed report only leaves the last one standing
                log.warning("node %s: engine use not observed: %s", cfg.node, exc)

    async def _watch_scheduler(self) -> None:
        """Read the engine scheduler's metrics: whether it runs (and so pauses batch), and
        what it did, published for ``/v1/capacity``."""
        cfg = self.config
        url = cfg.scheduler_metrics_url
        assert url is not None
        while True:
            seen = await read_engine_scheduler(url)
            if (seen is None) != (self.engine_scheduler is None):
                log.info(
                    "node %s: %s",
                    cfg.node,
                    f"the engine runs {seen.name}: it pauses batch for interactive work"
                    if seen is not None
                    else f"no engine scheduler answers at {url}: the work budget preempts",
                )
            self.engine_scheduler = seen
            if seen is not None:
                with contextlib.suppress(Exception):
                    await publish_scheduler(
                        self.ledger.client,
                        self.ledger.keys,
                        cfg.node,
                        seen,
                        3 * cfg.scheduler_poll_s,
                    )
            await asyncio.sleep(cfg.scheduler_poll_s)

    async def _watch_stalls(self) -> None:
        """Stop the attempts a hung engine holds (see ``DispatchConfig.stall_timeout_s``)."""
        timeout = self.config.stall_timeout_s
        interval = min(5.0, max(timeout / 4, 0.05))
        progress: int | None = None
        progressed_at = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            try:
                load = await self.engine.load()
                seen: int | None = load.prompt_tokens_total + load.generation_tokens_total
            except Exception as exc:  # no answer at all is no progress
                log.debug("node %s: no engine load for the stall watch: %s", self.config.node, exc)
                seen = None
            now = time.monotonic()
            if seen is not None and seen != progress:
                progress, progressed_at = seen, now
            stuck = stalled(self.view().running, progressed_at, now, timeout)
            for flight in self._flights(stuck):
                if self._cancel(flight, StopReason.STALLED):
                    self.stats.stalls += 1
                    self._engine_suspect = True
                    log.warning(
                        "node %s: item %s attempt %s: no output for %.0f s and no engine "
                        "progress; stopping it as an engine error",
                        self.config.node,
                        flight.item.id,
                        flight.item.attempt,
                        now - flight.last_chunk_at,
                    )

    async def _control_budget(self) -> None:
        """Step the work budget from fresh signals, preempt what it says, publish it."""
        cfg = self.config
        try:
            await self.clock.sync(redis_time(self.ledger.client))
            if self.work_budget is not None and cfg.work_budget is not None:
                self.work_budget = WorkBudget.initial(cfg.work_budget, self.clock.now())
        except Exception as exc:  # the first step tries again
            log.debug("node %s: Redis' clock not read: %s", cfg.node, exc)
        while True:
            await asyncio.sleep(cfg.budget_interval_s)
            try:
                await self._step_budget()
            except Exception as exc:  # a missed step leaves the last budget standing
                log.warning("node %s: work budget not stepped: %s", cfg.node, exc)

    async def _step_budget(self) -> None:
        cfg = self.config
        policy, before = cfg.work_budget, self.work_budget
        if policy is None or before is None:
            return
        try:
            now = await self.clock.refresh(redis_time(self.ledger.client))
        except Exception as exc:  # Redis trouble: go on from the last anchor
            log.debug("node %s: Redis' clock not read: %s", cfg.node, exc)
            now = self.clock.now()
        try:
            seen = await read_signals(
                self.ledger.client, self.ledger.keys, cfg.node, cfg.signal_ttl_s, now
            )
        except Exception as exc:  # Redis trouble: judge by the engine's queue alone
            log.debug("node %s: no gateway signals: %s", cfg.node, exc)
            seen = InteractiveSignals()
        read_at = time.monotonic()
        try:
            engine_waiting: int | None = (await self.engine.load()).num_requests_waiting
        except Exception as exc:  # the engine's metrics are missing: judge by the gateway's
            log.debug("node %s: no engine load: %s", cfg.node, exc)
            engine_waiting = None
        view = self.view(before)
        awaiting = sum(1 for f in view.active if f.first_token_at is None)
        try:
            others_awaiting = await exchange_batch_awaiting(
                self.ledger.client,
                self.ledger.keys,
                cfg.node,
                self._worker_id,
                awaiting,
                max(1.0, 4 * cfg.budget_interval_s),
                now,
            )
        except Exception as exc:  # Redis trouble: as if this worker were the node's only one
            log.debug("node %s: other workers' batch not read: %s", cfg.node, exc)
            others_awaiting = 0
        signals = budget_signals(
            view,
            seen,
            now_s=now,
            engine_waiting=engine_waiting,
            engine_read_at=read_at,
            other_batch_awaiting=others_awaiting,
        )
        decision = step(before, signals, policy)
        budget = self.work_budget = decision.budget
        if decision.changed:
            log.info("node %s: work budget %s", cfg.node, describe(budget))
        pauses = self.engine_scheduler is not None
        if decision.preempt and pauses:
            log.debug("node %s: no TTFT preemption: the engine pauses batch", cfg.node)
        victims = ttft_victims(decision.preempt, pauses, self.view().running)
        stopped = sum(self._cancel(f, StopReason.PREEMPTED) for f in self._flights(victims))
        self.stats.budget_preemptions += stopped
        if stopped:
            log.info(
                "node %s: preempted %s batch item(s) for interactive TTFT (%s)",
                cfg.node,
                stopped,
                decision.reason,
            )
        if budget_opened(before, budget):
            self._room.set()
        load = view.load
        published = BudgetView.of(budget, load.active, load.prefilling, now)
        with contextlib.suppress(Exception):
            await publish_budget(
                self.ledger.client,
                self.ledger.keys,
                cfg.node,
                self._worker_id,
                published,
                max(5.0, cfg.signal_ttl_s),
            )

    def _note_early_preemption(self, lease_id: str) -> None:
        """Keep a notice for a lease not registered (yet): another worker's on this node, or
        one of ours between its reservation and its start. Kept a minute (a start takes
        milliseconds), at most a few thousand."""
        now = time.monotonic()
        if len(self._early_preemptions) >= 4096:
            self._early_preemptions = {
                k: t for k, t in self._early_preemptions.items() if now - t < 60.0
            }
            if len(self._early_preemptions) >= 4096:
                self._early_preemptions.pop(next(iter(self._early_preemptions)))
        self._early_preemptions[lease_id] = now

    async def _listen_preemptions(self) -> None:
        while True:
            try:
                async with await self.ledger.listen_preemptions(self.config.node) as listener:
                    async for lease_id in listener:
                        item_id = self._by_lease.get(lease_id)
                        flight = self._in_flight.get(item_id) if item_id is not None else None
                        if flight is not None:
                            self._cancel(flight, StopReason.PREEMPTED)
                        elif item_id is None:
                            self._note_early_preemption(lease_id)
            except LedgerUnavailable as exc:
                log.warning("node %s: preemption channel lost: %s", self.config.node, exc)
                await asyncio.sleep(1.0)
