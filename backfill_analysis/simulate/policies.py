"""The admission policies compared by the simulator, all in front of the same engine.

``fifo``      no reserve: batch at a fixed concurrency, engine first come first served.
``static``    a static KV partition: batch reserves only from ``(1 - f) x C``, engine priority.
``priority``  engine priority only: batch at a fixed concurrency, no KV accounting.
``backfill``  the real admission policy (:func:`backfill.policy.decide`): batch from slack
              only, interactive may preempt batch (:func:`backfill.policy.choose_victims`),
              and a work budget that holds back new batch prefills while interactive waits.
``backfill-overcommit``  the same, charging batch for the measured output ratio
              (:func:`backfill.reservations.overcommit_from_ratios`) once enough items finished.
``backfill-budget``  "Backfill + work budget": the real admission policy, with the worker's
              own work budget controller (:mod:`backfill.work_budget`) stepped every
              ``control_interval_s`` from the signals the worker reads (gateway waiting and
              in prefill, recent TTFTs, the engine's queue), enforced and preempting through
              the worker's own plans (``backfill.dispatch``: ``start_room``, ``startable``,
              ``ttft_victims``, ``preemptible``).
``backfill-step``  Backfill's engine scheduler class: the engine pauses batch inside the step
              while interactive work waits or prefills, caps batch prefill per step in step
              time, bounds starvation, and takes blocks from batch first
              (:class:`~backfill_analysis.simulate.stepsched.StepSchedule`); in front of it the same
              KV ledger and work budget as ``backfill-budget``, except that the budget no
              longer preempts batch for TTFT (the engine pauses instead).
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from dataclasses import dataclass, field

from backfill.dispatch import BatchLoad, preemptible, start_room, startable, ttft_victims
from backfill.policy import (
    AdmissionRequest,
    ClassLimits,
    DecisionKind,
    PoolPolicy,
    PoolState,
    ServiceClass,
    decide,
)
from backfill.reservations import overcommit_from_ratios
from backfill.work_budget import WorkBudget, WorkBudgetPolicy, WorkSignals, step
from backfill_analysis.simulate.engine import DECODE, Engine, Sequence, StepReport
from backfill_analysis.simulate.prefix_cache import PrefixHolds, shareable_blocks
from backfill_analysis.simulate.stepsched import StepSchedule
from backfill_analysis.simulate.trace import TraceRequest
from backfill_analysis.simulate.workload import BatchItem

INTERACTIVE_PRIORITY = 0
BATCH_PRIORITY = 10
POLICY_NAMES = (
    "fifo",
    "static",
    "priority",
    "backfill",
    "backfill-overcommit",
    "backfill-budget",
    "backfill-step",
)


@dataclass(frozen=True)
class PolicyKnobs:
    """Settings of the policies (each uses the ones that concern it)."""

    batch_concurrency: int = 64
    """fifo and priority: batch requests kept in the engine."""
    reserve_fraction: float = 0.25
    """static, backfill: the interactive reserve as a share of the pool."""
    headroom_tokens: int = 0
    max_batch_seqs: int = 256
    """static, backfill: the worker's batch sequences in flight (its concurrency cap)."""
    busy_batch_seqs: int = 32
    """backfill: batch sequences in flight while interactive traffic is in the engine."""
    batch_prefill_tokens: int = 8192
    """backfill: batch prompt tokens admitted but not yet prefilled. Bounds how much batch
    prefill the next steps carry, so a returning interactive request never finds a queue of
    long batch prefill steps ahead of it."""
    max_preemptions_per_item: int = 3
    overcommit_quantile: float = 0.99
    work_budget: WorkBudgetPolicy = field(default_factory=WorkBudgetPolicy)
    """backfill-budget: the controller's parameters (as the worker's settings give them)."""
    control_interval_s: float = 0.25
    """backfill-budget: how often the controller steps (the worker's work_budget_interval_s);
    signals are as fresh as the last step, as in the worker."""
    step_schedule: StepSchedule = field(default_factory=StepSchedule)
    """backfill-step: the engine scheduler's settings."""
    prefix_accounting: bool = False
    """The reserving policies: a job's shared prompt prefix is reserved once per node while
    any item holding it runs, each item only its own blocks, the rest of a group waiting for
    its first holder's first token (issue 36); False: every item reserves its whole prompt."""


@dataclass
class BatchWork:
    """A batch item's progress across attempts."""

    item: BatchItem
    generated: int = 0
    preemptions: int = 0
    started_s: float = 0.0


class Lease:
    """A live reservation, shaped as :class:`backfill.policy.VictimCandidate`."""

    __slots__ = (
        "_engine",
        "deadline_ms",
        "lease_id",
        "preemptible",
        "seq",
        "service_class",
        "started_at_ms",
        "tokens",
    )

    def __init__(
        self,
        seq: Sequence,
        engine: Engine,
        service_class: ServiceClass,
        tokens: int,
        started_s: float,
        deadline_s: float | None,
        preemptible: bool,
    ) -> None:
        self.seq = seq
        self._engine = engine
        self.lease_id = str(seq.key)
        self.service_class = service_class
        self.tokens = tokens
        self.started_at_ms = int(started_s * 1000)
        self.deadline_ms = None if deadline_s is None else int(deadline_s * 1000)
        self.preemptible = preemptible

    @property
    def generated_tokens(self) -> int:
        seq = self.seq
        if seq.state == DECODE:
            return seq.generated + self._engine.step_index - seq.entry_step
        return seq.generated


class Frontend:
    """What every policy shares: the batch backlog in deadline order, submission, and the
    bookkeeping of finished and preempted work."""

    name = "base"
    priority_scheduling = True
    shapes_steps = False
    """True: the engine runs Backfill's step-shaping scheduler (``knobs.step_schedule``)."""

    def __init__(self, engine: Engine, items: list[BatchItem], knobs: PolicyKnobs) -> None:
        self.engine = engine
        self.knobs = knobs
        self._items = items
        self._next = 0
        self._requeued: list[tuple[float, int, BatchWork]] = []
        self.batch_in_flight = 0
        self.expired = 0
        self.rejected = 0
        self.completed: list[tuple[BatchWork, float]] = []
        self.policy_preemptions = 0
        self.policy_recomputed = 0
        self._keys = 1_000_000_000

    # -- the backlog -------------------------------------------------------------------------

    def peek_batch(self, now: float) -> BatchWork | None:
        """The next batch work by earliest deadline; expired items leave unstarted."""
        while True:
            cand_req = self._requeued[0][2] if self._requeued else None
            cand_new = self._items[self._next] if self._next < len(self._items) else None
            if cand_req is not None and (
                cand_new is None or cand_req.item.deadline_s <= cand_new.deadline_s
            ):
                work = cand_req
            elif cand_new is not None:
                work = BatchWork(cand_new)
            else:
                return None
            if work.item.deadline_s > now:
                return work
            self._take(work)
            self.expired += 1

    def _take(self, work: BatchWork) -> None:
        if self._requeued and self._requeued[0][2] is work:
            heapq.heappop(self._requeued)
        else:
            self._next += 1

    def submit_batch(self, work: BatchWork, now: float) -> Sequence:
        self._take(work)
        item = work.item
        # A resumed item continues from its stored output: the prompt grows by it.
        seq = Sequence(
            item.key,
            item.prompt_tokens,
            item.output_tokens,
            BATCH_PRIORITY,
            False,
            owner=work,
            generated=work.generated,
            prefix=item.job,
            prefix_blocks=shareable_blocks(
                item.prompt_tokens, item.prefix_tokens, self.engine.config.block_size
            ),
        )
        work.started_s = now
        self.engine.add(seq)
        self.batch_in_flight += 1
        return seq

    def submit_interactive(self, req: TraceRequest) -> Sequence:
        self._keys += 1
        seq = Sequence(
            self._keys, req.prompt_tokens, req.output_tokens, INTERACTIVE_PRIORITY, True, owner=req
        )
        self.engine.add(seq)
        return seq

    def preempt_batch(self, seq: Sequence) -> None:
        """Abort a running batch sequence and requeue its item with the output so far."""
        lease_generated = seq.generated
        if seq.state == DECODE:
            lease_generated += self.engine.step_index - seq.entry_step
        computed = seq.computed
        if seq.state == DECODE:
            computed = seq.entry_length + self.engine.step_index - seq.entry_step
        self.engine.abort(seq)
        work = seq.owner
        assert isinstance(work, BatchWork)
        work.generated = lease_generated
        work.preemptions += 1
        self.policy_preemptions += 1
        self.policy_recomputed += computed
        self.batch_in_flight -= 1
        self.on_batch_gone(seq)
        heapq.heappush(self._requeued, (work.item.deadline_s, work.item.key, work))

    # -- hooks -------------------------------------------------------------------------------

    def on_interactive(self, req: TraceRequest, now: float) -> None:
        self.submit_interactive(req)

    def before_step(self, now: float) -> None:
        """Admit what the policy allows before the engine schedules its next step."""

    def after_step(self, report: StepReport, now: float) -> None:
        for seq in report.finished:
            if seq.interactive:
                self.on_interactive_gone(seq)
            else:
                self.batch_in_flight -= 1
                work = seq.owner
                assert isinstance(work, BatchWork)
                work.generated = seq.output_tokens
                self.completed.append((work, now))
                self.on_batch_gone(seq)

    def on_batch_gone(self, seq: Sequence) -> None:
        """A batch sequence finished or was preempted by the policy."""

    def on_interactive_gone(self, seq: Sequence) -> None:
        """An interactive sequence finished."""


class Fifo(Frontend):
    """No reserve and no priority: batch at a fixed concurrency, mixed in arrival order."""

    name = "fifo"
    priority_scheduling = False

    def before_step(self, now: float) -> None:
        while self.batch_in_flight < self.knobs.batch_concurrency:
            work = self.peek_batch(now)
            if work is None:
                return
            self.submit_batch(work, now)


class PriorityOnly(Fifo):
    """Engine priority scheduling, nothing else."""

    name = "priority"
    priority_scheduling = True


class Reserving(Frontend):
    """Leases against the pool through :func:`backfill.policy.decide`."""

    def __init__(self, engine: Engine, items: list[BatchItem], knobs: PolicyKnobs) -> None:
        super().__init__(engine, items, knobs)
        cfg = engine.config
        self.capacity = cfg.capacity_tokens
        self.block_size = cfg.block_size
        self.pool_policy = PoolPolicy(
            interactive=ClassLimits(self.capacity),
            batch=ClassLimits(self.capacity),
            interactive_reserve_fraction=knobs.reserve_fraction,
            headroom_tokens=knobs.headroom_tokens,
        )
        self.interactive_in_use = 0
        self.batch_in_use = 0
        self.leases: dict[int, Lease] = {}
        self.gateway: deque[TraceRequest] = deque()
        self._deferred: tuple[object, ...] | None = None
        self.prefixes = PrefixHolds()
        """With ``knobs.prefix_accounting``: the shared prefixes the ledger holds once."""

    def state(self) -> PoolState:
        return PoolState(self.capacity, self.block_size, self.interactive_in_use, self.batch_in_use)

    def on_interactive(self, req: TraceRequest, now: float) -> None:
        self.gateway.append(req)
        self._admit_interactive(now)

    def _admit_interactive(self, now: float) -> None:
        while self.gateway:
            req = self.gateway[0]
            request = AdmissionRequest(
                ServiceClass.INTERACTIVE, req.prompt_tokens, req.output_tokens
            )
            decision = decide(request, self.state(), self.pool_policy, self._victim_pool())
            if decision.kind is DecisionKind.REJECT:
                self.gateway.popleft()
                self.rejected += 1
                continue
            if not decision.admitted:
                return
            for lease_id in decision.victims:
                self.preempt_batch(self.leases[int(lease_id)].seq)
            self.gateway.popleft()
            seq = self.submit_interactive(req)
            self.interactive_in_use += decision.tokens
            self.leases[seq.key] = Lease(
                seq, self.engine, ServiceClass.INTERACTIVE, decision.tokens, now, None, False
            )

    def _victim_pool(self) -> list[Lease]:
        return [x for x in self.leases.values() if x.service_class is ServiceClass.BATCH]

    def batch_may_start(self) -> bool:
        return self.batch_in_flight < self.knobs.max_batch_seqs

    def batch_state(self) -> PoolState:
        return self.state()

    def before_step(self, now: float) -> None:
        self._admit_interactive(now)
        while self.batch_may_start():
            work = self.peek_batch(now)
            if work is None:
                return
            item = work.item
            state = self.batch_state()
            # decide() is pure: the same request on the same pool under the same policy was
            # deferred last time and would be again.
            key = (
                id(work.item),
                work.generated,
                work.preemptions,
                state,
                self.pool_policy,
                self.prefixes.epoch,
            )
            if key == self._deferred:
                return
            prefix = self._prefix_share(item, now)
            if prefix is None:
                return  # the rest of its group waits for its first holder's first token
            # The prefix held once: an item pays ``round_up(prompt + max_output) - prefix``
            # of its own, and its first holder the prefix besides (what deciding on the pool
            # without the prefix's own hold charges).
            held = self.prefixes.held(item.job) if prefix else 0
            state = dataclasses.replace(state, batch_in_use=state.batch_in_use - held)
            remaining = item.max_output_tokens - work.generated
            request = AdmissionRequest(
                ServiceClass.BATCH,
                item.prompt_tokens + work.generated,
                max(1, remaining),
                preemptible=preemptible(work.preemptions, self.knobs.max_preemptions_per_item),
            )
            decision = decide(request, state, self.pool_policy)
            if decision.kind is DecisionKind.REJECT:
                self._take(work)
                self.rejected += 1
                continue
            if not decision.admitted:
                self._deferred = key
                return
            seq = self.submit_batch(work, now)
            if prefix:
                self.prefixes.take(seq.key, item.job, prefix, now)
            self.batch_in_use += decision.tokens - held
            self.leases[seq.key] = Lease(
                seq,
                self.engine,
                ServiceClass.BATCH,
                decision.tokens - prefix,
                now,
                item.deadline_s,
                request.preemptible,
            )

    def _prefix_share(self, item: BatchItem, now: float) -> int | None:
        """The tokens of ``item``'s shared prefix its lease leans on (0: reserve the whole
        prompt), or None: wait for the first holder's first token."""
        if not self.knobs.prefix_accounting:
            return 0
        bs = self.block_size
        tokens = shareable_blocks(item.prompt_tokens, item.prefix_tokens, bs) * bs
        return self.prefixes.share(item.job, tokens, now) if tokens else 0

    def after_step(self, report: StepReport, now: float) -> None:
        # Sequences the engine preempted itself (an overcommitted pool) keep their leases:
        # they wait inside the engine to recompute.
        for seq in report.first_tokens:
            self.prefixes.first_token(seq.key)
        super().after_step(report, now)
        self._admit_interactive(now)

    def on_batch_gone(self, seq: Sequence) -> None:
        lease = self.leases.pop(seq.key)
        self.batch_in_use -= lease.tokens + self.prefixes.release(seq.key)

    def on_interactive_gone(self, seq: Sequence) -> None:
        lease = self.leases.pop(seq.key)
        self.interactive_in_use -= lease.tokens


class StaticPartition(Reserving):
    """Batch reserves from ``(1 - f) x C`` whatever interactive does; no preemption."""

    name = "static"

    def _victim_pool(self) -> list[Lease]:
        return []

    def batch_state(self) -> PoolState:
        # Interactive use does not move the partition: batch sees only its own share.
        return PoolState(self.capacity, self.block_size, 0, self.batch_in_use)


class Backfill(Reserving):
    """Slack-only batch, preemption for interactive, and a work budget."""

    name = "backfill"

    def batch_may_start(self) -> bool:
        engine = self.engine
        if self.gateway or engine.interactive_pending():
            # New batch prefills would share the steps interactive prefills need.
            return False
        if engine.batch_prefill_backlog >= self.knobs.batch_prefill_tokens:
            return False
        if engine.interactive_running():
            return self.batch_in_flight < self.knobs.busy_batch_seqs
        return super().batch_may_start()


class BackfillOvercommit(Backfill):
    """Backfill, charging preemptible batch for the measured output ratio."""

    name = "backfill-overcommit"
    _refit_every = 500
    # The most recent outputs only: they describe the work running now, and refitting stays
    # cheap however many items finished.
    _window = 2_000

    def after_step(self, report: StepReport, now: float) -> None:
        before = len(self.completed)
        super().after_step(report, now)
        done = len(self.completed)
        if done // self._refit_every > before // self._refit_every:
            recent = self.completed[-self._window :]
            ratios = (w.item.output_tokens / w.item.max_output_tokens for w, _ in recent)
            overcommit = overcommit_from_ratios(ratios, self.knobs.overcommit_quantile)
            self.pool_policy = dataclasses.replace(self.pool_policy, batch_overcommit=overcommit)


class BackfillWorkBudget(Reserving):
    """Backfill + work budget: :func:`backfill.work_budget.step` decides, as in the worker."""

    name = "backfill-budget"
    preempts_for_ttft = True
    """The budget's TTFT preemptions are carried out (the worker in front of vLLM's stock
    scheduler)."""

    def __init__(self, engine: Engine, items: list[BatchItem], knobs: PolicyKnobs) -> None:
        super().__init__(engine, items, knobs)
        self.budget = WorkBudget.initial(knobs.work_budget, 0.0)
        self.budget_preemptions = 0
        self._next_control = 0.0
        self._now = 0.0
        self._ttfts: deque[tuple[float, float]] = deque(maxlen=64)
        self._interactive_pending: dict[int, float] = {}
        """Interactive sequences in the engine without a first token -> arrival."""
        self._batch_prefill: dict[int, int] = {}
        """Batch sequences without a first token -> prompt tokens (prefill, as the worker
        counts it: from start to first token)."""

    def submit_interactive(self, req: TraceRequest) -> Sequence:
        seq = super().submit_interactive(req)
        self._interactive_pending[seq.key] = req.arrival_s
        return seq

    def submit_batch(self, work: BatchWork, now: float) -> Sequence:
        seq = super().submit_batch(work, now)
        self._batch_prefill[seq.key] = work.item.prompt_tokens + work.generated
        return seq

    def before_step(self, now: float) -> None:
        self._now = now
        if now >= self._next_control:
            self._control(now)
            self._next_control = now + self.knobs.control_interval_s
        super().before_step(now)

    def _control(self, now: float) -> None:
        arrivals = [r.arrival_s for r in self.gateway]
        arrivals.extend(self._interactive_pending.values())
        decision = step(
            self.budget,
            WorkSignals(
                now_s=now,
                interactive_waiting=len(self.gateway),
                interactive_prefilling=len(self._interactive_pending),
                oldest_pending_since_s=min(arrivals, default=None),
                ttfts=tuple(self._ttfts),
                engine_waiting=self.engine.waiting,
                batch_in_flight=self.batch_in_flight,
                batch_awaiting_first_token=len(self._batch_prefill),
            ),
            self.knobs.work_budget,
        )
        self.budget = decision.budget
        # The worker's choice (``worker.dispatch_watch``): none while the engine pauses batch.
        pauses = not self.preempts_for_ttft
        for lease in ttft_victims(decision.preempt, pauses, self._victim_pool()):
            self.preempt_batch(lease.seq)
            self.budget_preemptions += 1

    def _load(self) -> BatchLoad:
        # Nothing is being stopped here: a preempted sequence leaves at once.
        in_flight = self.batch_in_flight
        return BatchLoad(in_flight, in_flight, sum(self._batch_prefill.values()))

    def batch_may_start(self) -> bool:
        # The worker's gates, in its order: the sequence cap and the work budget's room
        # (``start_room``), then whether the next prompt fits the prefill budget
        # (``startable``). The budget is judged only once the next item is known, as before:
        # looking at the backlog drops the items that expired meanwhile.
        load = self._load()
        if start_room(load, None, self.knobs.max_batch_seqs) == 0:
            return False
        work = self.peek_batch(self._now)
        if work is None:
            return True  # the admission loop ends on an empty backlog itself
        prompt = work.item.prompt_tokens + work.generated
        return start_room(load, self.budget, self.knobs.max_batch_seqs) > 0 and (
            startable(load, self.budget, [prompt]) == 1
        )

    def after_step(self, report: StepReport, now: float) -> None:
        for seq in report.first_tokens:
            if seq.interactive:
                arrival = self._interactive_pending.pop(seq.key, None)
                if arrival is not None:
                    self._ttfts.append((seq.first_token_s, seq.first_token_s - arrival))
            else:
                self._batch_prefill.pop(seq.key, None)
        super().after_step(report, now)

    def on_batch_gone(self, seq: Sequence) -> None:
        self._batch_prefill.pop(seq.key, None)
        super().on_batch_gone(seq)


class BackfillStep(BackfillWorkBudget):
    """Backfill's engine scheduler behind the KV ledger and the work budget: the engine
    pauses batch while interactive work is pending, so the budget only paces admission."""

    name = "backfill-step"
    shapes_steps = True
    preempts_for_ttft = False


POLICIES: dict[str, type[Frontend]] = {
    cls.name: cls
    for cls in (
        Fifo,
        StaticPartition,
        PriorityOnly,
        Backfill,
        BackfillOvercommit,
        BackfillWorkBudget,
        BackfillStep,
    )
}
