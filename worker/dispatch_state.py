"""What a node's dispatcher holds: its attempts in flight, its leases, its counters, and
the state its parts share. One :class:`DispatcherState` is built per dispatcher and given to
each part (``worker.dispatch`` composes them: ``worker.dispatch_check`` counts and judges,
``worker.dispatch_attempts`` runs, ``worker.dispatch_results`` writes results,
``worker.dispatch_watch`` watches leases, the engine and the work budget,
``worker.dispatch_prefixes`` finds shared prefixes); the moves here are those every part
makes on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, InitVar, dataclass, field
from typing import NamedTuple

from backfill import logs
from backfill.clock import HostClock, SharedClock
from backfill.dispatch import (
    DispatchConfig,
    FlightView,
    NodeView,
    PrefixView,
    RunPlan,
    StopReason,
)
from backfill.engine.protocol import Engine
from backfill.engine.shared_load import SharedLoad
from backfill.engine_scheduler import EngineScheduler
from backfill.errors import BackfillError, LedgerError, LedgerUnavailable
from backfill.ledger import BatchLedger, Lease, ReserveRequest
from backfill.store import AttemptStore, ClaimedItem, Finish
from backfill.work_budget import WorkBudget
from worker.response import ResponseAssembler

_log = logging.getLogger("backfill.worker")


@dataclass
class Flight:
    """One attempt in flight: an item run under a lease, with what its stream brought."""

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
    """``generated`` as last reported to the ledger (``AttemptRunner.report_progress``)."""
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
    claim_extended_at: float = field(default_factory=time.monotonic)
    """When its claim's expiry in Postgres was last set (taken before the write was sent):
    the heartbeat extends it when due (``claims_due``)."""

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


class Finished(NamedTuple):
    """An attempt's end, waiting for the result writer: its lease goes back once the record
    is durable."""

    finish: Finish
    flight: Flight


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
    over_reserved_samples: int = 0
    """Samples in which the engine held more KV than the node's ledger reserved (must stay
    0; ``backfill.observe.allocated_over_reserved``)."""
    over_reserved_max: int = 0
    """The most it held above them in one sample."""
    prefix_waits: int = 0
    """Claimed items left in the queue to wait for their shared prefix's first holder to
    prefill it (``backfill.dispatch.prefix_starts``), so they lean on it once it is cached."""


@dataclass(eq=False)
class DispatcherState:
    """The state of one node's dispatcher, built once and given to each of its parts
    (``worker.dispatch`` composes them), and the moves every part makes on it."""

    config: DispatchConfig
    engine: Engine
    repo: AttemptStore
    ledger: BatchLedger
    _: KW_ONLY
    model: str
    block_size: int
    max_sequence_tokens: int
    host_clock: InitVar[HostClock] = time.time
    clock: SharedClock = field(init=False)
    """Redis' clock, read here: the gateways' signal stamps and the published budgets are
    compared on it (this host's clock may be off; ``host_clock`` is it)."""
    engine_load: SharedLoad = field(init=False)
    """The budget, the observer and the stall watch share one /metrics read."""
    stats: DispatchStats = field(default_factory=DispatchStats)
    flights: dict[int, Flight] = field(default_factory=dict)
    """The attempts in flight, by item id."""
    by_lease: dict[str, int] = field(default_factory=dict)
    leases: dict[str, Lease] = field(default_factory=dict)
    """Every lease this dispatcher holds, from its reservation to its release: what is left
    here when the dispatcher stops is released then (see ``release_leftovers``), whatever
    path lost track of it."""
    early_preemptions: dict[str, float] = field(default_factory=dict)
    """Preemption notices for leases this dispatcher does not know yet: a lease preempted
    between its reservation and the item's registration (the notice comes while the start is
    written to Postgres; the ledger prefers exactly those newest leases as victims). Checked
    at registration so that such an item never reaches the engine."""
    worker_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    room: asyncio.Event = field(default_factory=asyncio.Event)
    """Wakes the claim loop: a lease ended, a prefill ended, an item finished, a job or a
    prefix pass's page became claimable. Set while the loop is not asleep (a claim under way
    that could not see it yet), it cuts the loop's next sleep."""
    typical_reservation: int = 0
    typical_prompt: int = 0
    decode_rate: float = field(init=False)
    engine_down: bool = False
    """Set when the engine stopped answering; cleared once it answers again."""
    engine_suspect: bool = False
    """Set when an attempt stalled on an engine that answers but makes no progress (hung):
    one item at a time is sent until one gets output again, so a hang spends the attempts of
    one item per stall timeout, not of every item the node could hold."""
    engine_scheduler: EngineScheduler | None = None
    """What the engine's step scheduler last said of itself; None: it runs none (or its
    metrics do not answer), and the work budget protects interactive alone."""
    work_budget: WorkBudget | None = field(init=False)

    def __post_init__(self, host_clock: HostClock) -> None:
        self.clock = SharedClock(host=host_clock)
        self.engine_load = SharedLoad(self.engine)
        self.decode_rate = self.config.decode_tokens_per_s
        policy = self.config.work_budget
        self.work_budget = None if policy is None else WorkBudget.initial(policy, self.clock.now())

    @property
    def engine_pauses_batch(self) -> bool:
        """Whether the engine's step scheduler pauses this worker's batch for interactive
        work: it runs, and takes batch at the very priority this worker sends (a mismatch is
        a misconfiguration, and the work budget keeps protecting interactive TTFT)."""
        seen = self.engine_scheduler
        return seen is not None and seen.batch_priority == self.config.batch_priority

    @property
    def in_flight(self) -> int:
        return len(self.flights)

    def view(self, budget: WorkBudget | None = None) -> NodeView:
        """What the plans know of this dispatcher now (``budget``: the work budget to judge
        by, if not the current one)."""
        return NodeView(
            flights=tuple(f.view() for f in self.flights.values()),
            budget=self.work_budget if budget is None else budget,
            engine_suspect=self.engine_suspect,
            typical_reservation=self.typical_reservation,
            typical_prompt=self.typical_prompt,
            leases_held=len(self.leases),
        )

    def prefix_view(self) -> PrefixView:
        """The shared prompt prefixes of the attempts in flight here: a prefix an attempt has
        prefilled (its first token came) is in the engine's cache, held there while it runs;
        one not prefilled yet has waited since its oldest attempt here started."""
        busy: set[str] = set()
        warm: set[str] = set()
        cold_since: dict[str, float] = {}
        for f in self.flights.values():
            pid = f.item.prefix_id
            if pid is None or f.stop_reason is not None:
                continue
            busy.add(pid)
            if f.first_token_at is not None:
                warm.add(pid)
            else:
                cold_since[pid] = min(cold_since.get(pid, f.started), f.started)
        now = time.monotonic()
        return PrefixView(
            self.config.prefix_caching,
            frozenset(warm),
            frozenset(busy),
            {pid: now - since for pid, since in cold_since.items() if pid not in warm},
        )

    def flights_of(self, views: Iterable[FlightView]) -> list[Flight]:
        """The attempts ``views`` show, those still held."""
        held = ((v, self.flights.get(v.item_id)) for v in views)
        return [f for v, f in held if f is not None and f.lease.lease_id == v.lease_id]

    async def sleep(self, seconds: float) -> None:
        """The claim loop's pause: until ``room`` is set or ``seconds`` pass. A wake since the
        last pause ended came while a claim was under way that may not have seen what it
        announced: this pause returns at once (one wake cuts one pause)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.room.wait(), seconds)
        self.room.clear()

    def work_claimable(self) -> None:
        """A job of this node's model became claimable: the claim loop claims now."""
        self.room.set()

    def cancel(self, flight: Flight, reason: StopReason) -> bool:
        """Stop a generating item's task for ``reason``; False when there was nothing to stop
        (already done or already being stopped)."""
        if flight.task is not None and not flight.task.done() and flight.stop_reason is None:
            flight.stop_reason = reason
            flight.task.cancel()
            return True
        return False

    def event(self, level: int, flight: Flight, action: str, message: str, *args: object) -> None:
        """Log an event of ``flight``'s attempt with its structured fields (``backfill.logs``):
        action, node, job, item, attempt, lease."""
        if not _log.isEnabledFor(level):
            return  # the common case at DEBUG: no fields built per attempt
        item = flight.item
        _log.log(
            level,
            message,
            *args,
            extra=logs.fields(
                action,
                node=self.config.node,
                job=item.job_id,
                item=item.id,
                attempt=item.attempt,
                lease=flight.lease.lease_id,
            ),
        )

    def prefilled(self, flight: Flight) -> None:
        """``flight``'s first token came: its prompt is prefilled. The claim loop is woken
        when that may let more start: its prompt left the work budget's prefill count, or
        its shared prefix is now cached, and the items of its group that wait for that lean
        on it (``backfill.dispatch.prefix_starts``)."""
        flight.first_token_at = time.monotonic()
        if self.work_budget is not None or flight.item.prefix_id is not None:
            self.room.set()

    def engine_progressed(self) -> None:
        """An attempt got output: an engine suspected of hanging makes progress again, and
        the claim loop may send it more than one item at a time."""
        if self.engine_suspect:
            _log.info("node %s: the engine makes progress again", self.config.node)
            self.engine_suspect = False
            self.room.set()

    def forget(self, flight: Flight) -> None:
        self.flights.pop(flight.item.id, None)
        self.by_lease.pop(flight.lease.lease_id, None)
        self.room.set()

    async def release(self, flight: Flight) -> None:
        self.forget(flight)
        await self.release_leases([flight.lease])

    async def release_leases(self, leases: Sequence[Lease]) -> None:
        """Give ``leases`` back to the node's slack (one round trip). When the ledger call
        fails (logged), they stay held here and are released at the dispatcher's stop, else
        when their TTL runs out, by the reaper."""
        if not leases:
            return
        try:
            await self.ledger.release_many(leases)
        except BackfillError as exc:
            _log.warning(
                "node %s: %d lease(s) not released: %s", self.config.node, len(leases), exc
            )
            return
        for lease in leases:
            self.leases.pop(lease.lease_id, None)
        # Their slack is free now: a claim loop woken when their attempts ended (before this
        # release was answered) may have read it held, claimed nothing and gone to sleep.
        self.room.set()

    async def release_unconfirmed(self, requests: list[ReserveRequest]) -> None:
        """Give back reservations whose answer was lost (their call failed on its connection:
        Redis may have granted them), so they do not hold the slack until their TTL runs out.
        Best effort: a ledger still out of reach leaves them to the TTL, as before."""
        if not requests:
            return
        try:
            await self.ledger.release_unconfirmed(requests)
        except (LedgerError, LedgerUnavailable) as exc:
            _log.warning(
                "node %s: %d reservations of unknown outcome left to their TTL: %s",
                self.config.node,
                len(requests),
                exc,
            )

    async def release_leftovers(self) -> None:
        """At the dispatcher's stop: release every lease it still holds. None should be left
        (each attempt releases its own); one that is would hold the node's slack until the
        reaper reclaims it, and a node whose workers restart without a reaper would stall."""
        left = list(self.leases.values())
        if not left:
            return
        _log.warning(
            "node %s: %d lease(s) still held at stop (%s); releasing them",
            self.config.node,
            len(left),
            ", ".join(lease.lease_id for lease in left[:5]),
        )
        await self.release_leases(left)

    def partial(self, flight: Flight) -> str | None:
        text = "".join(flight.text.get(0, []))
        return text or None
