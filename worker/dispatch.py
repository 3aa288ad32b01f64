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
from dataclasses import dataclass, field
from typing import Any

from backfill.clock import HostClock, SharedClock, redis_time
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
from backfill.ledger import (
    AsyncLedger,
    Denial,
    Lease,
    LeaseStatus,
    PartialBatchError,
    ReserveRequest,
)
from backfill.observe import observed_non_batch
from backfill.policy import ServiceClass
from backfill.prefill import PromptCount, prefill_plan
from backfill.refusals import InvalidRequest
from backfill.results import http_error_record
from backfill.states import ItemState
from backfill.store import ClaimedItem, Finish, Repository, Start
from backfill.work_budget import (
    WorkBudget,
    WorkBudgetPolicy,
    WorkSignals,
    admissible,
    budget_victims,
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
from worker.embeddings import embed
from worker.prepare import Prepared, RunPlan, over_limit, run_plan, seconds_needed
from worker.response import ResponseAssembler

log = logging.getLogger("backfill.worker")

# The result writer's waits between tries while Postgres is out of reach (doubling).
RESULT_RETRY_FIRST_S = 0.5
RESULT_RETRY_MAX_S = 10.0
# Prompt token counts the dispatcher remembers (item id -> tokens), so an item given back
# unstarted is not counted again when it is claimed again.
_COUNTED_KEPT = 65_536


ENGINE_GAUGE_LAG_S = 2.0
"""How stale the engine's ``num_requests_waiting`` may be against this worker's own view of its
batch (one engine step on a loaded CPU, plus the metrics read)."""


def _prefilling(active: list[_InFlight]) -> int:
    """Prompt tokens of the items still awaiting their first token: what counts against the
    work budget's prefill room."""
    return sum(f.prefill_tokens for f in active if f.first_token_at is None)


@dataclass(frozen=True)
class DispatchConfig:
    """How one node's dispatcher behaves."""

    node: str
    claim_batch: int = 64
    max_in_flight: int = 128
    """Sequences in flight at most (the engine's own ``--max-num-seqs`` is the other cap)."""
    lease_ttl_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    idle_poll_s: float = 0.5
    batch_priority: int = 10
    """vLLM priority of batch requests (lower runs first; interactive uses 0)."""
    stream_interval: int = 1
    """Output tokens per streamed chunk asked of the engine (1: every token)."""
    max_preemptions: int = 3
    """At this many preemptions an item reserves as non-preemptible (no thrashing)."""
    max_attempts: int = 5
    """An item whose attempts keep failing (engine errors, crashes) fails after this many."""
    grace_s: float = 30.0
    """On stop, how long in-flight items may finish before they are aborted and requeued."""
    result_flush_s: float = 0.05
    decode_tokens_per_s: float = 20.0
    """Per-sequence decode rate assumed until one is measured (deadline feasibility)."""
    prefill_tokens_per_s: float = 1000.0
    settle_every_tokens: int = 32
    """An item's progress is reported to the ledger once it grew by this many tokens..."""
    settle_interval_s: float = 1.0
    """...at the next of these intervals, for every such item of the node in one round trip
    (``settle_many``). One call per item per 32 tokens was ~9 Redis calls per 300-token item,
    ~90,000 calls/s for a 1,000-node fleet (``bench.fleet``); progress only steers the choice
    of preemption victims, which a second-old figure serves as well."""
    tokenize_concurrency: int = 8
    """Prompt counts asked of the engine at once. vLLM's ``/tokenize`` serves a few
    concurrent requests best: on 2 cores, 8 at once counted ~150-220 prompts/s and 64 at once
    ~40-70/s (both httpx and the server slow down with many connections), and a claim's items
    start only once all of them are counted."""
    observe_interval_s: float = 1.0
    """How often the engine's non-batch KV use is reported to the ledger (``backfill.observe``);
    0 turns it off."""
    work_budget: WorkBudgetPolicy | None = None
    """The batch work budget's controller (``backfill.work_budget``); None: no work budget,
    only ``max_in_flight`` and the KV slack bound batch."""
    budget_interval_s: float = 0.25
    """How often the work budget is stepped from fresh signals."""
    signal_ttl_s: float = 3.0
    """Gateway signals older than this are ignored (the gateway that wrote them is gone)."""
    scheduler_metrics_url: str | None = None
    """Where the engine's step scheduler (``backfill_vllm``) serves its metrics. While they
    answer, the engine pauses batch itself and the work budget preempts nothing for TTFT."""
    scheduler_poll_s: float = 5.0
    stall_timeout_s: float = 120.0
    """An attempt whose stream sent nothing for this long while its engine made no progress
    at all (no token prefilled or generated for anyone) is stopped as an engine error: a hung
    engine must not hold items and leases until their deadlines. Waiting behind interactive
    work is not a stall: the engine is busy then. 0 turns the watch off."""


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
    stop_reason: str | None = None
    """Why the dispatcher cancelled it: preempted, lease_lost, claim_lost, stalled, shutdown."""
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    """Until its first token the item is in prefill: it counts against the work budget's
    prefill tokens."""
    last_chunk_at: float = field(default_factory=time.monotonic)
    """When the engine last sent anything for it (the stall watch's clock)."""


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


def _backoff_s(attempt: int) -> float:
    """How long an item whose attempt failed on its own account waits before the next."""
    return float(min(0.25 * 2 ** max(attempt - 1, 0), 5.0))


def _error_json(code: str, message: str) -> str:
    return json.dumps({"code": code, "message": message})


def _refused_json(exc: EngineRejected, code: str = "engine_rejected") -> str:
    """An engine's 4xx as the error file writes HTTP errors (its own error object kept)."""
    return http_error_record(exc.status, code, exc.message, error=exc.error)


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
            self._cancel(flight, "shutdown")
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
        room = cfg.max_in_flight - len(self._in_flight)
        budget = self.work_budget
        if budget is not None:
            if budget.hold:
                return 0
            room = min(room, budget.max_seqs - len(self._active()))
        if self._engine_suspect:
            room = min(room, 1 - len(self._in_flight))
        if room <= 0:
            return 0
        if self._engine_down and not await self._engine_answers():
            # Claiming now would only cycle items through claim -> requeue, each time
            # spending one of their attempts, for as long as the engine is down.
            return 0
        snap = await self.ledger.snapshot(cfg.node)
        if snap is None or not snap.ready or snap.slack < self.block_size:
            return 0
        # Claim no more than the slack could take, judged by recent reservations, so a busy
        # node does not churn items through claim -> deferred.
        want = min(room, cfg.claim_batch)
        if self._typical_reservation:
            fit = snap.slack // self._typical_reservation
            if fit == 0 and self._in_flight:
                # Less slack than one typical reservation while leases are held: the claim
                # would be deferred at reserve time (a retry delay for the item, writes for
                # Postgres) and requeued. A lease ending frees slack and wakes the loop.
                return 0
            want = max(1, min(want, fit))
        if budget is not None and self._typical_prompt:
            # Nor more than the work budget's prefill room could start: a claim it cuts short
            # goes back to the queue, and claiming it again costs Postgres writes each time.
            active = self._active()
            want = admissible(
                budget, len(active), _prefilling(active), [self._typical_prompt] * want
            )
            if want == 0:
                return 0  # woken when a prefill ends (first token) or an item finishes
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
    ) -> list[Prepared]:
        """Exact prompt tokens of what each item will run, class limit and deadline, before
        any engine work. Deadlines are judged on Postgres' clock: the time left at the claim
        (asked at ``claiming``, monotonic; now if not given) less the time counting took."""
        if claiming is None:
            claiming = time.monotonic()
        prepared = await asyncio.gather(
            *(self._prepare(c) for c in claimed), return_exceptions=True
        )
        ready: list[Prepared] = []
        for item, outcome in zip(claimed, prepared, strict=True):
            if isinstance(outcome, EngineRejected):
                await self._fail_claimed(item, _refused_json(outcome, "invalid_request"))
                continue
            if isinstance(outcome, InvalidRequest):
                refusal = http_error_record(400, outcome.code, outcome.message, param=outcome.param)
                await self._fail_claimed(item, refusal)
                continue
            if isinstance(outcome, EngineUnavailable):
                # The engine could not count (down, overloaded): give the item back untouched.
                self._engine_down = True
                await self._give_back(item, ItemState.QUEUED, f"tokenize failed: {outcome}")
                continue
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            if isinstance(outcome, BaseException):
                # Not the engine's absence but something about this item: it fails the same
                # way each time it is tried, so it counts against the item's attempts.
                await self._retry_or_fail(item, f"the prompt could not be counted: {outcome!r}")
                continue
            refused = over_limit(outcome.count, outcome.max_output, self.max_sequence_tokens)
            if refused is not None:
                await self._fail_claimed(
                    item, http_error_record(400, "context_length_exceeded", refused)
                )
                continue
            need_s = seconds_needed(outcome, self.config.prefill_tokens_per_s, self._decode_rate)
            left_s = item.deadline_left_s - (time.monotonic() - claiming)
            if need_s > left_s:
                reason = (
                    f"needs about {need_s:.1f} s at {self._decode_rate:.1f} tokens/s; "
                    f"{max(left_s, 0):.1f} s left before the deadline"
                )
                with contextlib.suppress(StaleWrite):
                    await asyncio.to_thread(self.repo.expire_claimed, item.id, item.attempt, reason)
                self.stats.expired += 1
                continue
            ready.append(outcome)
        return ready

    async def _retry_or_fail(self, item: ClaimedItem, error: str) -> None:
        """A claimed item whose attempt failed for a reason of its own: back off and try
        again (a poison item must not hold the head of the queue), failing at the cap."""
        if item.attempt >= self.config.max_attempts:
            await self._fail_claimed(
                item,
                _error_json(
                    "retries_exhausted", f"{item.attempt} attempts failed; last error: {error}"
                ),
            )
            return
        await self._give_back(item, ItemState.QUEUED, error, _backoff_s(item.attempt))

    async def _prepare(self, item: ClaimedItem) -> Prepared:
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
        return Prepared(item, run, count, prompt_tokens)

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
        self._typical_prompt = (
            count.total
            if not self._typical_prompt
            else (3 * self._typical_prompt + count.total) // 4
        )
        return count

    async def _reserve_and_start(self, ready: list[Prepared]) -> int:
        cfg = self.config
        ready = await self._fit_to_slack(ready)
        if not ready:
            return 0
        requests = [
            ReserveRequest(
                node=cfg.node,
                service_class=ServiceClass.BATCH,
                # What this run prefills (a continuation's prompt carries its partial
                # output) and what it may still generate, for every sequence it creates.
                prompt_tokens=p.count.longest,
                max_output_tokens=p.max_output,
                n=p.count.sequences,
                owner=f"{cfg.node}/{p.item.id}/{p.item.attempt}",
                preemptible=p.item.preemptions < cfg.max_preemptions,
                deadline_ms=int(p.item.deadline.timestamp() * 1000),
                ttl_ms=int(cfg.lease_ttl_s * 1000),
            )
            for p in ready
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
            for p in ready:
                await self._give_back(p.item, ItemState.QUEUED, "ledger unavailable")
            raise
        starts: list[Start] = []
        leased: dict[int, tuple[Prepared, Lease]] = {}
        for prepared, outcome in zip(ready, outcomes, strict=True):
            item = prepared.item
            if isinstance(outcome, BaseException):
                log.warning("node %s: reserve failed for item %s: %s", cfg.node, item.id, outcome)
                await self._give_back(item, ItemState.QUEUED, f"reserve failed: {outcome}")
                continue
            if isinstance(outcome, Denial):
                if outcome.permanent:
                    await self._fail_claimed(
                        item, _error_json("reservation_refused", str(outcome.reason))
                    )
                else:
                    retry = outcome.retry_after_s or 1.0
                    await self._give_back(
                        item, ItemState.DEFERRED, f"no slack: {outcome.reason}", retry
                    )
                continue
            self._typical_reservation = (
                outcome.tokens
                if not self._typical_reservation
                else (3 * self._typical_reservation + outcome.tokens) // 4
            )
            starts.append(
                Start(
                    item.id,
                    item.attempt,
                    outcome.lease_id,
                    outcome.fencing_token,
                    outcome.tokens,
                    prepared.prompt_tokens,
                )
            )
            leased[item.id] = (prepared, outcome)
        if not starts:
            return 0
        applied = set(await asyncio.to_thread(self.repo.start_many, starts, cfg.lease_ttl_s))
        orphans = [lease for i, (_, lease) in leased.items() if i not in applied]
        if orphans:
            # Their claims moved on (cancelled, reaped) between claim and start.
            await self.ledger.release_many(orphans)
        for item_id in applied:
            prepared, lease = leased[item_id]
            item, run = prepared.item, prepared.run
            flight = _InFlight(
                item=item,
                lease=lease,
                endpoint=item.endpoint,
                run=run,
                prompt_tokens=prepared.prompt_tokens,
                prefill_tokens=prepared.count.total,
                # Progress of earlier attempts is this one's from the start: a preemption
                # before its first token must keep it, not store zero.
                generated=run.kept,
                text={0: [item.partial_output]} if run.kept and item.partial_output else {},
            )
            self._in_flight[item.id] = flight
            self._by_lease[lease.lease_id] = item.id
            if self._early_preemptions.pop(lease.lease_id, None) is not None:
                # Preempted before it started: keep its progress, requeue it, no engine work.
                flight.stop_reason = "preempted"
                flight.task = asyncio.create_task(self._stopped(flight), name=f"item-{item.id}")
                continue
            flight.task = asyncio.create_task(self._generate(flight), name=f"item-{item.id}")
            flight.task.add_done_callback(functools.partial(self._cancelled_early, flight=flight))
        self.stats.started += len(applied)
        return len(applied)

    async def _fit_to_slack(self, ready: list[Prepared]) -> list[Prepared]:
        """The prefix of ``ready`` (in the claim's order: fair share, then deadlines) that the
        node's slack can take now; the rest goes back to the queue at once, in one write (no
        deferral churn)."""
        snap = await self.ledger.snapshot(self.config.node)
        slack = 0 if snap is None else snap.slack
        fits: list[Prepared] = []
        used = 0
        for prepared in ready:
            need = prepared.reservation(self.block_size)
            # The first item goes to the ledger even when it looks too big only if the node
            # holds nothing (the slack may have grown; a denial then says why); with leases
            # held it goes back to the queue at once instead of being deferred.
            if used + need > slack and (fits or self._in_flight):
                break
            fits.append(prepared)
            used += need
        budgeted = self._fit_to_budget(fits)
        detail = "work budget full" if len(budgeted) < len(fits) else "slack full"
        fits = budgeted
        rest = ready[len(fits) :]
        if rest:
            await asyncio.to_thread(
                self.repo.unclaim, [(p.item.id, p.item.attempt) for p in rest], detail
            )
        return fits

    def _fit_to_budget(self, fits: list[Prepared]) -> list[Prepared]:
        """The prefix of ``fits`` the work budget lets start now."""
        budget = self.work_budget
        if budget is None:
            return fits
        active = self._active()
        prompts = [p.count.total for p in fits]
        return fits[: admissible(budget, len(active), _prefilling(active), prompts)]

    async def _fail_claimed(self, item: ClaimedItem, error: str) -> None:
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(self.repo.fail, item.id, item.attempt, error)
        self.stats.failed += 1

    async def _give_back(
        self, item: ClaimedItem, target: ItemState, detail: str, retry_after_s: float = 0.0
    ) -> None:
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(
                self.repo.give_back,
                item.id,
                item.attempt,
                target,
                retry_after_s=retry_after_s or None,
                detail=detail,
            )
        if target is ItemState.DEFERRED:
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
        if flight.endpoint == Endpoint.EMBEDDINGS:
            await self._embed(flight, request, request_id)
            return
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
            await self._finish(flight, ItemState.FAILED, error=_refused_json(exc))
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

    async def _embed(self, flight: _InFlight, request: dict[str, Any], request_id: str) -> None:
        """An embeddings attempt (``worker.embeddings``): one call, nothing partial to keep."""
        try:
            answer = await embed(
                self.engine,
                request,
                model=self.model,
                priority=self.config.batch_priority,
                request_id=request_id,
            )
        except EngineRejected as exc:
            await self._finish(flight, ItemState.FAILED, error=_refused_json(exc))
            return
        except (EngineError, OSError) as exc:
            await self._engine_trouble(flight, exc)
            return
        if self._engine_suspect:
            log.info("node %s: the engine makes progress again", self.config.node)
            self._engine_suspect = False
            self._room.set()
        self._check_reservation(flight, answer.prompt_tokens, 0)
        await self._finish(flight, ItemState.SUCCEEDED, result=json.dumps(answer.body))

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
        try:
            if item.attempt >= self.config.max_attempts:
                with contextlib.suppress(StaleWrite):
                    await asyncio.to_thread(
                        functools.partial(
                            self.repo.fail,
                            item.id,
                            item.attempt,
                            _error_json(
                                "retries_exhausted",
                                f"{item.attempt} attempts failed; last error: {exc!r}",
                            ),
                            fencing_token=flight.lease.fencing_token,
                        )
                    )
                self.stats.failed += 1
            else:
                await self._requeue(
                    flight, f"worker error: {exc!r}", retry_after_s=_backoff_s(item.attempt)
                )
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
        reason = flight.stop_reason or "shutdown"
        try:
            if reason == "preempted":
                await asyncio.to_thread(
                    self.repo.preempt,
                    item.id,
                    item.attempt,
                    lease.fencing_token,
                    partial_output=self._partial(flight),
                    partial_tokens=flight.generated,
                )
                self.stats.preempted += 1
            elif reason in ("shutdown", "lease_lost"):
                await self._requeue(flight, reason)
            elif reason == "stalled":
                await self._engine_trouble(
                    flight,
                    EngineUnavailable(
                        f"the stream sent nothing for {self.config.stall_timeout_s:.0f} s "
                        "while the engine made no progress"
                    ),
                )
                return
            # claim_lost: the item was cancelled, expired or reaped; nothing of ours to write.
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
        if item.attempt >= self.config.max_attempts:
            await self._finish(
                flight,
                ItemState.FAILED,
                error=_error_json(
                    "retries_exhausted",
                    f"the engine failed {item.attempt} attempts; last error: {exc}",
                ),
            )
            return
        try:
            await self._requeue(flight, f"engine error: {exc}")
        finally:
            await self._release(flight)

    async def _requeue(
        self, flight: _InFlight, detail: str, *, retry_after_s: float | None = None
    ) -> None:
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
                    detail=detail,
                    retry_after_s=retry_after_s,
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

    def _cancel(self, flight: _InFlight, reason: str) -> bool:
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
                if flight.item.id not in held:
                    self._cancel(flight, "claim_lost")
                    continue
                try:
                    beat = await self.ledger.heartbeat(
                        cfg.node,
                        flight.lease.lease_id,
                        flight.lease.fencing_token,
                        ttl_ms=int(cfg.lease_ttl_s * 1000),
                    )
                except BackfillError:
                    continue
                if beat.status is LeaseStatus.PREEMPTED:
                    self._cancel(flight, "preempted")
                elif beat.status in (LeaseStatus.EXPIRED, LeaseStatus.FENCED):
                    # No reservation covers this request any more: stop engine work at once.
                    self._cancel(flight, "lease_lost")
                elif beat.status is LeaseStatus.UNKNOWN:
                    await self._lease_missing(flight)

    async def _lease_missing(self, flight: _InFlight) -> None:
        """The ledger has no trace of a lease this worker holds: Redis lost writes (a restart,
        or a replica promoted before a write reached it). The attempt is still live in
        Postgres, so the work goes on; the node is closed to batch until the next maintenance
        tick rebuilds its ledger from Postgres, which counts the lease again (until then its
        tokens may be handed out twice: the window is one heartbeat plus one tick)."""
        try:
            if await self.ledger.mark_incomplete(self.config.node):
                log.warning(
                    "node %s: lease %s of item %s is missing from the ledger; batch closed "
                    "on the node until it is rebuilt from Postgres",
                    self.config.node,
                    flight.lease.lease_id,
                    flight.item.id,
                )
        except BackfillError as exc:
            log.warning("node %s: could not close for a rebuild: %s", self.config.node, exc)

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
            for flight in stalled(self._running(), progressed_at, now, timeout):
                if self._cancel(flight, "stalled"):
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

    def _active(self) -> list[_InFlight]:
        """In-flight items not being stopped: what counts against the work budget."""
        return [f for f in self._in_flight.values() if f.stop_reason is None]

    def _running(self) -> list[_InFlight]:
        """Active items still generating (not done and waiting for their result to be
        written): the only ones a preemption can stop."""
        return [f for f in self._active() if f.task is not None and not f.task.done()]

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
        active = self._active()
        awaiting = [f for f in active if f.first_token_at is None]
        # The gauge is as old as the engine's last step, and the read itself takes a while:
        # batch whose first token came since may still be counted in it as waiting.
        started_since_read = sum(
            1
            for f in active
            if f.first_token_at is not None and f.first_token_at >= read_at - ENGINE_GAUGE_LAG_S
        )
        try:
            others_awaiting = await exchange_batch_awaiting(
                self.ledger.client,
                self.ledger.keys,
                cfg.node,
                self._worker_id,
                len(awaiting),
                max(1.0, 4 * cfg.budget_interval_s),
                now,
            )
        except Exception as exc:  # Redis trouble: as if this worker were the node's only one
            log.debug("node %s: other workers' batch not read: %s", cfg.node, exc)
            others_awaiting = 0
        decision = step(
            before,
            WorkSignals(
                now_s=now,
                interactive_waiting=seen.waiting,
                interactive_prefilling=seen.prefilling,
                oldest_pending_since_s=seen.oldest_pending_since_s,
                ttfts=seen.ttfts,
                engine_waiting=engine_waiting,
                batch_in_flight=len(active),
                batch_awaiting_first_token=len(awaiting),
                other_batch_awaiting_first_token=others_awaiting,
                batch_started_since_engine_read=started_since_read,
            ),
            policy,
        )
        budget = self.work_budget = decision.budget
        if decision.changed:
            log.info("node %s: work budget %s", cfg.node, describe(budget))
        if decision.preempt and self.engine_scheduler is not None:
            # The engine pauses batch in the steps interactive work needs (its scheduler):
            # preempting would only throw batch work away.
            log.debug("node %s: no TTFT preemption: the engine pauses batch", cfg.node)
        elif decision.preempt:
            victims = budget_victims((_FlightVictim(f) for f in self._running()), decision.preempt)
            stopped = sum(self._cancel(victim.flight, "preempted") for victim in victims)
            self.stats.budget_preemptions += stopped
            if stopped:
                log.info(
                    "node %s: preempted %s batch item(s) for interactive TTFT (%s)",
                    cfg.node,
                    stopped,
                    decision.reason,
                )
        if (before.hold and not budget.hold) or budget.max_seqs > before.max_seqs:
            self._room.set()
        view = BudgetView.of(budget, len(active), _prefilling(active), now)
        with contextlib.suppress(Exception):
            await publish_budget(
                self.ledger.client,
                self.ledger.keys,
                cfg.node,
                self._worker_id,
                view,
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
                            self._cancel(flight, "preempted")
                        elif item_id is None:
                            self._note_early_preemption(lease_id)
            except LedgerUnavailable as exc:
                log.warning("node %s: preemption channel lost: %s", self.config.node, exc)
                await asyncio.sleep(1.0)


def stalled(
    flights: list[_InFlight], progressed_at: float, now: float, timeout_s: float
) -> list[_InFlight]:
    """The attempts that heard nothing from the engine for ``timeout_s``, counted from their
    last chunk or the engine's last progress, whichever came later."""
    return [f for f in flights if now - max(f.last_chunk_at, progressed_at) > timeout_s]


@dataclass(frozen=True)
class _FlightVictim:
    """An in-flight item as :func:`backfill.work_budget.budget_victims` sees a lease."""

    flight: _InFlight

    @property
    def lease_id(self) -> str:
        return self.flight.lease.lease_id

    @property
    def service_class(self) -> ServiceClass:
        return ServiceClass.BATCH

    @property
    def tokens(self) -> int:
        return self.flight.lease.tokens

    @property
    def generated_tokens(self) -> int:
        # Output of this attempt only: a resumed item keeps what earlier attempts produced.
        return self.flight.generated - self.flight.run.kept

    @property
    def started_at_ms(self) -> int:
        return int(self.flight.started * 1000)

    @property
    def deadline_ms(self) -> int | None:
        return self.flight.lease.deadline_ms

    @property
    def preemptible(self) -> bool:
        return self.flight.lease.preemptible
