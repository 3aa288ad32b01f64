"""Capacity lab: one request stream against one capacity, as a cache and as KV reservations.

A working set of ``s`` identifiers is requested round-robin (1, 2, ..., s, 1, 2, ...) against
``C`` slots, two ways:

- :func:`simulate_lru` is the toy world of caches: a miss evicts the least recently used
  entry, for free, and the evicted entry can be fetched again later at the cost of one miss.
  With ``s > C`` round-robin is LRU's worst case: every entry is evicted just before it is
  asked for again, so nothing ever hits.
- :func:`simulate_kv` is the engine's world. An identifier is a *sequence* whose KV cache
  holds its context; throwing that away is not free, because the next token cannot be
  computed without it (the prompt and everything generated so far must be prefilled again).
  So no one evicts anything: each sequence reserves its worst case up front, decided by the
  real admission policy (:func:`backfill.policy.decide`); what does not fit waits in a
  queue; interactive sequences may preempt batch ones, whose generated tokens are kept, so
  they resume later at the price of a prefill and lose no decode work.

Pure and deterministic: the dashboard's Capacity lab page plays these traces step by step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import StrEnum

from backfill.policy import (
    AdmissionRequest,
    DecisionKind,
    PoolPolicy,
    PoolState,
    ServiceClass,
    decide,
)
from backfill.reservations import reservation_tokens

MAX_REQUESTS = 4096
MAX_CAPACITY_SLOTS = 64
MAX_WORKING_SET = 256
MAX_SEQUENCE_PART_TOKENS = 4096
BLOCK_SIZE = 16
"""Tokens per slot: one KV block, so a slot in the cache picture is a block in the pool."""


def round_robin(working_set: int, requests: int) -> list[int]:
    """``1, 2, ..., working_set, 1, 2, ...``, ``requests`` long."""
    return [i % working_set + 1 for i in range(requests)]


def _check(name: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {low}..{high}, not {value}")


# -- the toy world: a cache with LRU eviction


@dataclass(frozen=True)
class LruStep:
    """One request in the cache world, and the cache after it."""

    index: int
    """1-based position in the stream."""
    identifier: int
    hit: bool
    evicted: int | None
    """The entry thrown out to make room (a miss in a full cache)."""
    slots: tuple[int | None, ...]
    """Slot contents; an entry keeps its slot until evicted, so the picture stays still."""
    hits: int
    misses: int


@dataclass(frozen=True)
class LruTrace:
    capacity_slots: int
    working_set: int
    steps: tuple[LruStep, ...]

    @property
    def hits(self) -> int:
        return self.steps[-1].hits if self.steps else 0


def simulate_lru(capacity_slots: int, working_set: int, requests: int = 16) -> LruTrace:
    """The round-robin stream through an LRU cache of ``capacity_slots`` entries."""
    _check("capacity_slots", capacity_slots, 1, MAX_CAPACITY_SLOTS)
    _check("working_set", working_set, 1, MAX_WORKING_SET)
    _check("requests", requests, 1, MAX_REQUESTS)
    slots: list[int | None] = [None] * capacity_slots
    recency: OrderedDict[int, int] = OrderedDict()  # identifier -> slot, oldest first
    hits = misses = 0
    steps: list[LruStep] = []
    for index, identifier in enumerate(round_robin(working_set, requests), start=1):
        evicted: int | None = None
        hit = identifier in recency
        if hit:
            hits += 1
            recency.move_to_end(identifier)
        else:
            misses += 1
            if len(recency) < capacity_slots:
                slot = slots.index(None)
            else:
                evicted, slot = recency.popitem(last=False)
            slots[slot] = identifier
            recency[identifier] = slot
        steps.append(LruStep(index, identifier, hit, evicted, tuple(slots), hits, misses))
    return LruTrace(capacity_slots, working_set, tuple(steps))


# -- the engine's world: sequences reserve KV tokens under the real admission policy


class Outcome(StrEnum):
    """What one request did in the KV world."""

    HIT = "hit"
    """The sequence was resident: one token decoded with its context in place."""
    ADMIT = "admit"
    """A new sequence reserved its worst case and was prefilled (its first token with it)."""
    RESUME = "resume"
    """A preempted sequence was admitted again: its prompt and kept output are prefilled once
    more, and no decode work is lost."""
    DEFER = "defer"
    """No room: the sequence waits in the queue and the engine does no work for it."""
    REJECT = "reject"
    """The sequence could never fit what its class may use on this pool."""


class EventKind(StrEnum):
    """Everything that changes the pool; nothing leaves it any other way."""

    ADMIT = "admit"
    RESUME = "resume"
    PREEMPT = "preempt"
    """A batch sequence gave its room to an interactive one; its output so far is kept."""
    FINISH = "finish"
    """A sequence generated its last token and gave its reservation back."""
    DEFER = "defer"
    REJECT = "reject"


@dataclass(frozen=True)
class KvEvent:
    kind: EventKind
    identifier: int
    service_class: ServiceClass
    tokens: int
    """The reservation taken (admit, resume) or given back (preempt, finish)."""
    generated: int
    """Output tokens the sequence has made so far; a preemption keeps them."""


@dataclass(frozen=True)
class KvLabConfig:
    """The stream and the pool; a slot is one KV block of :data:`BLOCK_SIZE` tokens."""

    capacity_slots: int
    working_set: int
    requests: int = 16
    prompt_tokens: int = 12
    output_tokens: int = 4
    """``max_tokens`` of each sequence; one request decodes one token, so a sequence lasts
    this many of its own requests and then finishes."""
    interactive_every: int = 0
    """Identifiers k, 2k, ... are interactive sequences; 0: all batch."""
    reserve_slots: int = 0
    """The interactive reserve: slots batch may never take."""
    max_preemptions: int = 3
    """Then a batch sequence runs to its end, not preemptible (as an item's cap)."""

    def __post_init__(self) -> None:
        _check("capacity_slots", self.capacity_slots, 1, MAX_CAPACITY_SLOTS)
        _check("working_set", self.working_set, 1, MAX_WORKING_SET)
        _check("requests", self.requests, 1, MAX_REQUESTS)
        _check("prompt_tokens", self.prompt_tokens, 0, MAX_SEQUENCE_PART_TOKENS)
        _check("output_tokens", self.output_tokens, 1, MAX_SEQUENCE_PART_TOKENS)
        _check("interactive_every", self.interactive_every, 0, MAX_WORKING_SET)
        _check("reserve_slots", self.reserve_slots, 0, self.capacity_slots)
        _check("max_preemptions", self.max_preemptions, 0, 100)

    def service_class(self, identifier: int) -> ServiceClass:
        k = self.interactive_every
        return ServiceClass.INTERACTIVE if k and identifier % k == 0 else ServiceClass.BATCH


@dataclass(frozen=True)
class KvStep:
    """One request in the KV world, and the pool after it."""

    index: int
    identifier: int
    service_class: ServiceClass
    outcome: Outcome
    reason: str
    """The admission policy's own words for its decision (or why none was needed)."""
    events: tuple[KvEvent, ...]
    slots: tuple[int | None, ...]
    """Which sequence holds each block; a sequence's blocks need not be adjacent (paged)."""
    interactive_tokens: int
    batch_tokens: int
    free_tokens: int
    queue: tuple[int, ...]
    """Waiting sequences in the order they will be tried: interactive first, then batch."""
    hits: int
    admits: int
    resumes: int
    deferrals: int
    preemptions: int
    finished: int
    rejections: int
    recomputed_tokens: int
    """Prefill spent again on context a preemption threw away: the price of preempting."""


@dataclass(frozen=True)
class KvTrace:
    config: KvLabConfig
    capacity_tokens: int
    block_size: int
    sequence_tokens: int
    """Each sequence's reservation: ``round_up(prompt + max_tokens, block_size)``."""
    reserve_tokens: int
    interactive: tuple[int, ...]
    """The identifiers that are interactive sequences."""
    steps: tuple[KvStep, ...]

    @property
    def hits(self) -> int:
        return self.steps[-1].hits if self.steps else 0


@dataclass
class _Sequence:
    identifier: int
    service_class: ServiceClass
    generated: int = 0
    preemptions: int = 0
    tokens: int = 0
    """Reserved now; 0 while it waits."""
    started_at: int = 0
    admitted_before: bool = False


@dataclass(frozen=True)
class _Lease:
    """A resident sequence as :func:`backfill.policy.choose_victims` sees a lease."""

    lease_id: str
    service_class: ServiceClass
    tokens: int
    generated_tokens: int
    started_at_ms: int
    deadline_ms: int | None
    preemptible: bool


class _KvPool:
    def __init__(self, config: KvLabConfig) -> None:
        self.config = config
        self.policy = PoolPolicy(interactive_reserve_tokens=config.reserve_slots * BLOCK_SIZE)
        self.capacity = config.capacity_slots * BLOCK_SIZE
        self.slots: list[int | None] = [None] * config.capacity_slots
        self.live: dict[int, _Sequence] = {}
        self.resident: dict[int, _Sequence] = {}
        self.in_use = {ServiceClass.INTERACTIVE: 0, ServiceClass.BATCH: 0}
        self.queue: list[int] = []
        self.events: list[KvEvent] = []
        self.hits = self.admits = self.resumes = self.deferrals = 0
        self.preemptions = self.finished = self.rejections = self.recomputed = 0

    def state(self) -> PoolState:
        return PoolState(
            self.capacity,
            BLOCK_SIZE,
            interactive_in_use=self.in_use[ServiceClass.INTERACTIVE],
            batch_in_use=self.in_use[ServiceClass.BATCH],
        )

    def preemptible(self, seq: _Sequence) -> bool:
        return seq.preemptions < self.config.max_preemptions

    def victim_candidates(self) -> list[_Lease]:
        # Only batch can be preempted: interactive residents would be looked at and skipped.
        return [
            _Lease(
                str(s.identifier),
                s.service_class,
                s.tokens,
                s.generated,
                s.started_at,
                None,
                self.preemptible(s),
            )
            for s in self.resident.values()
            if s.service_class is ServiceClass.BATCH
        ]

    def event(self, kind: EventKind, seq: _Sequence, tokens: int) -> None:
        self.events.append(KvEvent(kind, seq.identifier, seq.service_class, tokens, seq.generated))

    def enqueue(self, seq: _Sequence, *, front: bool = False) -> None:
        interactive = [
            i for i in self.queue if self.live[i].service_class is ServiceClass.INTERACTIVE
        ]
        if seq.service_class is ServiceClass.INTERACTIVE or front:
            # Interactive is the protected class; a preempted batch sequence was admitted
            # before anything queued behind it, so it goes first among batch.
            self.queue.insert(len(interactive), seq.identifier)
        else:
            self.queue.append(seq.identifier)

    def place(self, seq: _Sequence, tokens: int, step: int) -> None:
        free = [i for i, holder in enumerate(self.slots) if holder is None]
        need = tokens // BLOCK_SIZE
        if need > len(free):
            raise RuntimeError("the policy admitted more than the pool holds")
        for i in free[:need]:
            self.slots[i] = seq.identifier
        seq.tokens = tokens
        self.resident[seq.identifier] = seq
        self.in_use[seq.service_class] += tokens
        seq.started_at = step

    def release(self, seq: _Sequence) -> int:
        tokens, seq.tokens = seq.tokens, 0
        del self.resident[seq.identifier]
        self.in_use[seq.service_class] -= tokens
        self.slots = [None if holder == seq.identifier else holder for holder in self.slots]
        return tokens

    def preempt(self, seq: _Sequence) -> None:
        # The engine drops the sequence's KV blocks; its output so far is stored, so on
        # resume only the context is prefilled again, and no token is decoded twice.
        tokens = self.release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.event(EventKind.PREEMPT, seq, tokens)
        self.enqueue(seq, front=True)

    def decode(self, seq: _Sequence) -> None:
        seq.generated += 1
        if seq.generated >= self.config.output_tokens:
            tokens = self.release(seq)
            self.finished += 1
            self.event(EventKind.FINISH, seq, tokens)
            del self.live[seq.identifier]

    def drain(self, step: int, requester: _Sequence | None) -> dict[int, str]:
        """Try the queue in order until one does not fit; the requester, if admitted, decodes
        its first token. Returns the policy's reason for each sequence tried."""
        reasons: dict[int, str] = {}
        first_refusal: str | None = None
        for identifier in list(self.queue):
            seq = self.live[identifier]
            cfg = self.config
            request = AdmissionRequest(
                seq.service_class,
                cfg.prompt_tokens + seq.generated,
                cfg.output_tokens - seq.generated,
                preemptible=self.preemptible(seq),
            )
            decision = decide(request, self.state(), self.policy)
            if (
                seq.service_class is ServiceClass.INTERACTIVE
                and decision.kind is DecisionKind.DEFER
            ):
                # Leases matter only to an interactive request that does not fit as it is
                # (only it may preempt): listing them for every decision cost most of a
                # long trace's time.
                decision = decide(request, self.state(), self.policy, self.victim_candidates())
            reasons[identifier] = decision.reason
            if decision.kind is DecisionKind.REJECT:
                self.queue.remove(identifier)
                del self.live[identifier]
                self.rejections += 1
                self.event(EventKind.REJECT, seq, 0)
                continue
            if not decision.admitted:
                first_refusal = decision.reason
                break
            for victim in decision.victims:
                self.preempt(self.live[int(victim)])
            self.queue.remove(identifier)
            self.place(seq, decision.tokens, step)
            if seq.admitted_before:
                self.resumes += 1
                self.recomputed += cfg.prompt_tokens + seq.generated
                self.event(EventKind.RESUME, seq, decision.tokens)
            else:
                self.admits += 1
                self.event(EventKind.ADMIT, seq, decision.tokens)
            seq.admitted_before = True
            if seq is requester:
                self.decode(seq)
        if requester is not None and requester.identifier not in reasons and first_refusal:
            ahead = self.queue.index(requester.identifier)
            reasons[requester.identifier] = (
                f"waits behind {ahead} queued sequence(s); the first: {first_refusal}"
            )
        return reasons

    def request(self, step: int, identifier: int) -> tuple[_Sequence, Outcome, str]:
        seq = self.live.get(identifier)
        if seq is not None and seq.tokens:
            self.hits += 1
            held = seq.tokens
            self.decode(seq)
            out = self.config.output_tokens
            reason = f"resident: decoded token {seq.generated} of {out} with its context in place"
            if seq.generated >= out:
                reason += f"; finished and gave back its {held} tokens"
            self.drain(step, None)
            return seq, Outcome.HIT, reason
        if seq is None:
            seq = _Sequence(identifier, self.config.service_class(identifier))
            self.live[identifier] = seq
            self.enqueue(seq)
        resuming = seq.admitted_before
        reasons = self.drain(step, seq)
        reason = reasons.get(identifier, "")
        if seq.tokens or seq.generated >= self.config.output_tokens:
            return seq, (Outcome.RESUME if resuming else Outcome.ADMIT), reason
        if identifier not in self.live:
            return seq, Outcome.REJECT, reason
        self.deferrals += 1
        self.event(EventKind.DEFER, seq, 0)
        return seq, Outcome.DEFER, reason


def simulate_kv(config: KvLabConfig) -> KvTrace:
    """The round-robin stream as sequences reserving KV tokens, one admission decision of
    :func:`backfill.policy.decide` at a time."""
    pool = _KvPool(config)
    steps: list[KvStep] = []
    for index, identifier in enumerate(round_robin(config.working_set, config.requests), start=1):
        pool.events = []
        seq, outcome, reason = pool.request(index, identifier)
        interactive = pool.in_use[ServiceClass.INTERACTIVE]
        batch = pool.in_use[ServiceClass.BATCH]
        steps.append(
            KvStep(
                index=index,
                identifier=identifier,
                service_class=seq.service_class,
                outcome=outcome,
                reason=reason,
                events=tuple(pool.events),
                slots=tuple(pool.slots),
                interactive_tokens=interactive,
                batch_tokens=batch,
                free_tokens=pool.capacity - interactive - batch,
                queue=tuple(pool.queue),
                hits=pool.hits,
                admits=pool.admits,
                resumes=pool.resumes,
                deferrals=pool.deferrals,
                preemptions=pool.preemptions,
                finished=pool.finished,
                rejections=pool.rejections,
                recomputed_tokens=pool.recomputed,
            )
        )
    return KvTrace(
        config,
        pool.capacity,
        BLOCK_SIZE,
        reservation_tokens(config.prompt_tokens, config.output_tokens, BLOCK_SIZE),
        pool.policy.reserve_tokens(pool.capacity),
        tuple(
            i
            for i in range(1, config.working_set + 1)
            if config.service_class(i) is ServiceClass.INTERACTIVE
        ),
        tuple(steps),
    )
