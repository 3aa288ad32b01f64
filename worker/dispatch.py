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
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

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
from backfill.repository import ClaimedItem, Finish, Repository, Start
from backfill.states import ItemState
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
from worker.engine import (
    Endpoint,
    Engine,
    EngineError,
    EngineRejected,
    EngineUnavailable,
    ResumeUnsupported,
    resume_request,
)

log = logging.getLogger("backfill.worker")

# The result writer's waits between tries while Postgres is out of reach (doubling).
RESULT_RETRY_FIRST_S = 0.5
RESULT_RETRY_MAX_S = 10.0
# Prompt token counts the dispatcher remembers (item id -> tokens), so an item given back
# unstarted is not counted again when it is claimed again.
_COUNTED_KEPT = 65_536


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


@dataclass
class _InFlight:
    item: ClaimedItem
    lease: Lease
    endpoint: str
    prompt_tokens: int = 0
    """The original prompt's tokens: with ``generated``, what the sequence holds in the engine."""
    task: asyncio.Task[None] | None = None
    generated: int = 0
    text: dict[int, list[str]] = field(default_factory=dict)
    stop_reason: str | None = None
    """Why the dispatcher cancelled it: preempted, lease_lost, claim_lost, shutdown."""
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    """Until its first token the item is in prefill: it counts against the work budget's
    prefill tokens."""

    @property
    def prefill_tokens(self) -> int:
        # A resumed item prefills its partial output again, with its prompt.
        return self.prompt_tokens + self.item.partial_tokens


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


def _now() -> datetime:
    return datetime.now(UTC)


def _error_json(code: str, message: str) -> str:
    return json.dumps({"code": code, "message": message})


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
    ) -> None:
        self.config = config
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
        self._counted: OrderedDict[int, int] = OrderedDict()
        self._cleanups: set[asyncio.Task[None]] = set()
        self._decode_rate = config.decode_tokens_per_s
        self._tokenize_slots = asyncio.Semaphore(config.tokenize_concurrency)
        # Set when the engine stopped answering; cleared once it answers again.
        self._engine_down = False
        policy = config.work_budget
        self.work_budget: WorkBudget | None = (
            None if policy is None else WorkBudget.initial(policy, time.time())
        )

    # -----------------------------------------------------------------------------------------
    # Lifecycle

    async def run(self) -> None:
        """Dispatch until :meth:`stop`; then drain (grace period), requeue the rest, return."""
        writer = asyncio.create_task(self._write_results(), name="results")
        helpers = [
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
            asyncio.create_task(self._listen_preemptions(), name="preemptions"),
        ]
        if self.config.observe_interval_s > 0:
            helpers.append(asyncio.create_task(self._observe(), name="observe"))
        if self.config.work_budget is not None:
            helpers.append(asyncio.create_task(self._control_budget(), name="work-budget"))
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
            want = max(1, min(want, snap.slack // self._typical_reservation))
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
        claimed = await asyncio.to_thread(self.repo.claim, cfg.node, want, cfg.lease_ttl_s)
        if not claimed:
            return 0
        self.stats.claimed += len(claimed)
        ready = await self._check(claimed)
        if not ready:
            # Every claimed item was settled here (failed, expired, given back to be tried
            # again): that is progress, not idleness. Sleeping an idle poll instead would let
            # a poison item at the head of the queue stall the node once per retry.
            return len(claimed)
        return await self._reserve_and_start(ready)

    async def _check(self, claimed: list[ClaimedItem]) -> list[tuple[ClaimedItem, int, str]]:
        """Exact prompt tokens, class limit and deadline, before any engine work."""
        counted = await asyncio.gather(
            *(self._prompt_tokens(c) for c in claimed), return_exceptions=True
        )
        ready: list[tuple[ClaimedItem, int, str]] = []
        for item, tokens in zip(claimed, counted, strict=True):
            endpoint = item.endpoint
            if isinstance(tokens, EngineRejected):
                await self._fail_claimed(item, _error_json("invalid_request", tokens.message))
                continue
            if isinstance(tokens, EngineUnavailable):
                # The engine could not count (down, overloaded): give the item back untouched.
                self._engine_down = True
                await self._give_back(item, ItemState.QUEUED, f"tokenize failed: {tokens}")
                continue
            if isinstance(tokens, BaseException):
                # Not the engine's absence but something about this item: it fails the same
                # way each time it is tried, so it counts against the item's attempts.
                if item.attempt >= self.config.max_attempts:
                    await self._fail_claimed(
                        item,
                        _error_json(
                            "retries_exhausted",
                            f"the prompt could not be counted in {item.attempt} attempts; "
                            f"last error: {tokens!r}",
                        ),
                    )
                else:
                    # Back off, so that a poison item does not hold the head of the queue.
                    await self._give_back(
                        item,
                        ItemState.QUEUED,
                        f"tokenize failed: {tokens!r}",
                        min(0.25 * 2 ** max(item.attempt - 1, 0), 5.0),
                    )
                continue
            total = tokens + item.max_output_tokens
            if total > self.max_sequence_tokens:
                await self._fail_claimed(
                    item,
                    _error_json(
                        "context_length_exceeded",
                        f"prompt ({tokens} tokens) + max_tokens ({item.max_output_tokens}) = "
                        f"{total} exceeds the batch limit of {self.max_sequence_tokens} tokens",
                    ),
                )
                continue
            remaining = item.max_output_tokens - item.partial_tokens
            need_s = (tokens / self.config.prefill_tokens_per_s) + remaining / self._decode_rate
            left_s = (item.deadline - _now()).total_seconds()
            if need_s > left_s:
                reason = (
                    f"needs about {need_s:.1f} s at {self._decode_rate:.1f} tokens/s; "
                    f"{max(left_s, 0):.1f} s left before the deadline"
                )
                with contextlib.suppress(StaleWrite):
                    await asyncio.to_thread(self.repo.expire_claimed, item.id, item.attempt, reason)
                self.stats.expired += 1
                continue
            ready.append((item, tokens, endpoint))
        return ready

    async def _prompt_tokens(self, item: ClaimedItem) -> int:
        if item.prompt_tokens is not None:
            return item.prompt_tokens
        known = self._counted.get(item.id)
        if known is not None:
            return known
        body = json.loads(item.body)
        model = str(body.get("model") or self.model)
        async with self._tokenize_slots:
            if item.endpoint == Endpoint.CHAT_COMPLETIONS:
                tokens = await self.engine.tokenize_chat(body["messages"], self.model or model)
            else:
                tokens = await self.engine.tokenize_prompt(str(body["prompt"]), self.model or model)
        self._counted[item.id] = tokens
        if len(self._counted) > _COUNTED_KEPT:
            self._counted.popitem(last=False)
        self._typical_prompt = (
            tokens if not self._typical_prompt else (3 * self._typical_prompt + tokens) // 4
        )
        return tokens

    async def _reserve_and_start(self, ready: list[tuple[ClaimedItem, int, str]]) -> int:
        cfg = self.config
        ready = await self._fit_to_slack(ready)
        if not ready:
            return 0
        requests = [
            ReserveRequest(
                node=cfg.node,
                service_class=ServiceClass.BATCH,
                # A resumed item's prompt carries its partial output; its worst case is
                # unchanged: prompt + max_output in all.
                prompt_tokens=tokens + item.partial_tokens,
                max_output_tokens=max(1, item.max_output_tokens - item.partial_tokens),
                owner=f"{cfg.node}/{item.id}/{item.attempt}",
                preemptible=item.preemptions < cfg.max_preemptions,
                deadline_ms=int(item.deadline.timestamp() * 1000),
                ttl_ms=int(cfg.lease_ttl_s * 1000),
            )
            for item, tokens, _ in ready
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
            for item, _, _ in ready:
                await self._give_back(item, ItemState.QUEUED, "ledger unavailable")
            raise
        starts: list[Start] = []
        leased: dict[int, tuple[ClaimedItem, Lease, str]] = {}
        prompt_of: dict[int, int] = {}
        for (item, tokens, endpoint), outcome in zip(ready, outcomes, strict=True):
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
                    tokens,
                )
            )
            leased[item.id] = (item, outcome, endpoint)
            prompt_of[item.id] = tokens
        if not starts:
            return 0
        applied = set(await asyncio.to_thread(self.repo.start_many, starts, cfg.lease_ttl_s))
        orphans = [lease for i, (_, lease, _) in leased.items() if i not in applied]
        if orphans:
            # Their claims moved on (cancelled, reaped) between claim and start.
            await self.ledger.release_many(orphans)
        for item_id in applied:
            item, lease, endpoint = leased[item_id]
            flight = _InFlight(
                item=item,
                lease=lease,
                endpoint=endpoint,
                prompt_tokens=prompt_of[item_id],
                # Progress of earlier attempts is this one's from the start: a preemption
                # before its first token must keep it, not store zero.
                generated=item.partial_tokens,
                text={0: [item.partial_output]} if item.partial_output else {},
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

    async def _fit_to_slack(
        self, ready: list[tuple[ClaimedItem, int, str]]
    ) -> list[tuple[ClaimedItem, int, str]]:
        """The deadline-ordered prefix of ``ready`` that the node's slack can take now; the rest
        goes back to the queue at once, in one write (no deferral churn)."""
        snap = await self.ledger.snapshot(self.config.node)
        slack = 0 if snap is None else snap.slack
        fits: list[tuple[ClaimedItem, int, str]] = []
        used = 0
        for entry in ready:
            item, tokens, _ = entry
            need = -(-(tokens + item.max_output_tokens) // self.block_size) * self.block_size
            if used + need > slack and fits:
                break
            fits.append(entry)
            used += need
        budgeted = self._fit_to_budget(fits)
        detail = "work budget full" if len(budgeted) < len(fits) else "slack full"
        fits = budgeted
        rest = ready[len(fits) :]
        if rest:
            await asyncio.to_thread(
                self.repo.unclaim, [(i.id, i.attempt) for i, _, _ in rest], detail
            )
        return fits

    def _fit_to_budget(
        self, fits: list[tuple[ClaimedItem, int, str]]
    ) -> list[tuple[ClaimedItem, int, str]]:
        """The prefix of ``fits`` the work budget lets start now."""
        budget = self.work_budget
        if budget is None:
            return fits
        active = self._active()
        prompts = [tokens + item.partial_tokens for item, tokens, _ in fits]
        return fits[: admissible(budget, len(active), _prefilling(active), prompts)]

    async def _fail_claimed(self, item: ClaimedItem, error: str) -> None:
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(self.repo.fail, item.id, item.attempt, error)
        self.stats.failed += 1

    async def _give_back(
        self, item: ClaimedItem, target: ItemState, detail: str, retry_after_s: float = 0.0
    ) -> None:
        not_before = _now() + timedelta(seconds=retry_after_s) if retry_after_s else None
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(
                self.repo.give_back,
                item.id,
                item.attempt,
                target,
                not_before=not_before,
                detail=detail,
            )
        if target is ItemState.DEFERRED:
            self.stats.deferred += 1

    # -----------------------------------------------------------------------------------------
    # Generation

    async def _generate(self, flight: _InFlight) -> None:
        item = flight.item
        body: dict[str, Any] = json.loads(item.body)
        request_id = f"bf-{item.id}-{item.attempt}"
        # Tokens generated by earlier attempts. Their text may be empty (a detokenizer holds
        # back an incomplete UTF-8 sequence), so progress is judged by the count.
        done = item.partial_tokens
        request = dict(body)
        if done and done >= item.max_output_tokens:
            # Preempted after its last token: the answer is complete; nothing to run.
            response = self._response_body(flight, request_id, {0: "length"}, None)
            await self._finish(flight, ItemState.SUCCEEDED, result=json.dumps(response))
            return
        if done:
            try:
                request = resume_request(flight.endpoint, body, item.partial_output or "", done)
            except ResumeUnsupported:
                # Continuing would change the answer's meaning: run it whole again.
                done = flight.generated = 0
                flight.text = {}
        request["model"] = self.model
        finish_reasons: dict[int, str] = {}
        usage_prompt: int | None = None
        completion = 0
        settled = 0
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
                    for choice in chunk.choices:
                        flight.text.setdefault(choice.index, []).append(choice.text)
                        if choice.finish_reason:
                            finish_reasons[choice.index] = choice.finish_reason
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
                    if flight.generated - settled >= self.config.settle_every_tokens:
                        settled = flight.generated
                        await self._settle(flight)
        except asyncio.CancelledError:
            await self._stopped(flight)
            return
        except EngineRejected as exc:
            await self._finish(
                flight, ItemState.FAILED, error=_error_json("engine_rejected", exc.message)
            )
            return
        except (EngineError, OSError) as exc:
            await self._engine_trouble(flight, exc)
            return
        elapsed = time.monotonic() - flight.started
        if completion and elapsed > 0:
            rate = completion / elapsed
            self._decode_rate = 0.8 * self._decode_rate + 0.2 * max(rate, 0.1)
        response = self._response_body(flight, request_id, finish_reasons, usage_prompt)
        await self._finish(flight, ItemState.SUCCEEDED, result=json.dumps(response))

    def _response_body(
        self,
        flight: _InFlight,
        request_id: str,
        finish_reasons: Mapping[int, str],
        usage_prompt: int | None,
    ) -> dict[str, Any]:
        """The non-streaming response the endpoint would have sent, assembled from the stream
        (and, after a preemption, from the partial output the earlier attempt produced)."""
        item = flight.item
        prompt = item.prompt_tokens if item.prompt_tokens is not None else usage_prompt or 0
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": flight.generated,
            "total_tokens": prompt + flight.generated,
        }
        created = int(time.time())
        indexes = sorted(flight.text) or [0]
        if flight.endpoint == Endpoint.CHAT_COMPLETIONS:
            return {
                "id": f"chatcmpl-{request_id}",
                "object": "chat.completion",
                "created": created,
                "model": self.model,
                "choices": [
                    {
                        "index": i,
                        "message": {
                            "role": "assistant",
                            "content": "".join(flight.text.get(i, [])),
                        },
                        "finish_reason": finish_reasons.get(i, "stop"),
                        "logprobs": None,
                    }
                    for i in indexes
                ],
                "usage": usage,
            }
        return {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": self.model,
            "choices": [
                {
                    "index": i,
                    "text": "".join(flight.text.get(i, [])),
                    "finish_reason": finish_reasons.get(i, "stop"),
                    "logprobs": None,
                }
                for i in indexes
            ],
            "usage": usage,
        }

    async def _settle(self, flight: _InFlight) -> None:
        # Generated-so-far lets the ledger pick victims that lose the least work.
        with contextlib.suppress(BackfillError):
            await self.ledger.settle(
                self.config.node,
                flight.lease.lease_id,
                flight.lease.fencing_token,
                flight.generated,
            )

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
                await asyncio.to_thread(
                    self.repo.requeue,
                    item.id,
                    item.attempt,
                    lease.fencing_token,
                    partial_output=self._partial(flight),
                    partial_tokens=flight.generated,
                    detail=reason,
                )
                self.stats.requeued += 1
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
            await asyncio.to_thread(
                self.repo.requeue,
                item.id,
                item.attempt,
                flight.lease.fencing_token,
                partial_output=self._partial(flight),
                partial_tokens=flight.generated,
                detail=f"engine error: {exc}",
            )
            self.stats.requeued += 1
        except StaleWrite:
            pass
        finally:
            await self._release(flight)

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
        now = time.time()
        try:
            seen = await read_signals(
                self.ledger.client, self.ledger.keys, cfg.node, cfg.signal_ttl_s, now
            )
        except Exception as exc:  # Redis trouble: judge by the engine's queue alone
            log.debug("node %s: no gateway signals: %s", cfg.node, exc)
            seen = InteractiveSignals()
        try:
            engine_waiting: int | None = (await self.engine.load()).num_requests_waiting
        except Exception as exc:  # the engine's metrics are missing: judge by the gateway's
            log.debug("node %s: no engine load: %s", cfg.node, exc)
            engine_waiting = None
        active = self._active()
        awaiting = [f for f in active if f.first_token_at is None]
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
            ),
            policy,
        )
        budget = self.work_budget = decision.budget
        if decision.changed:
            log.info("node %s: work budget %s", cfg.node, describe(budget))
        if decision.preempt:
            victims = budget_victims(
                (_FlightVictim(f) for f in self._running()), decision.preempt
            )
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
        return self.flight.generated - self.flight.item.partial_tokens

    @property
    def started_at_ms(self) -> int:
        return int(self.flight.started * 1000)

    @property
    def deadline_ms(self) -> int | None:
        return self.flight.lease.deadline_ms

    @property
    def preemptible(self) -> bool:
        return self.flight.lease.preemptible
