"""Admission policy: pure values and pure functions, no I/O.

A decision function looks at a pool's state and returns a :class:`Decision`; the caller acts
on it (as vLLM's ``KVCacheManager.allocate_slots`` returns ``None`` when a request does not
fit). The ledger's Lua scripts apply exactly these formulas atomically in Redis; tests compare
the two on random states, so a change here must be made in ``backfill/lua/`` too.

Symbols (tokens, per node)::

    C      capacity (measured from the engine: num_gpu_blocks x block_size)
    R      interactive reserve (policy: tokens, or a fraction of C rounded up)
    I      interactive in use (gateway leases)
    O      engine-observed non-batch use; interactive that bypasses the gateway is still
           interactive demand, so batch sees I_eff = max(I, O)
    B      batch in use (batch leases)
    h, s   headroom for interactive bursts, safety margin

    batch slack       = max(0, C - max(R, I_eff + h) - B - s)
    interactive room  = max(0, C - I - B)     interactive may use all but batch's share,
                                              and may preempt batch to get more
    tenant share      = floor(C x share)      what one tenant's interactive leases may hold
                                              on the node (a tenant holding none is not
                                              refused by it)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, TypeVar

from backfill.reservations import PPM, BatchOvercommit, reservation_tokens


class ServiceClass(StrEnum):
    """Traffic classes sharing one engine's KV pool."""

    INTERACTIVE = "interactive"
    """Latency-bound requests through the gateway; own the reserve, may preempt batch."""
    BATCH = "batch"
    """Throughput work with deadlines; only ever uses slack."""


class DecisionKind(StrEnum):
    """What the caller should do with a request."""

    ADMIT = "admit"
    """Reserve now."""
    DEFER = "defer"
    """Not now; try again after ``retry_after_s`` (no engine work, deadline kept)."""
    REJECT = "reject"
    """Never: over the class limit, or larger than the pool could ever give this class."""
    PREEMPT_THEN_ADMIT = "preempt_then_admit"
    """Interactive only: preempt the named batch leases, then reserve."""


class Reason(StrEnum):
    """Machine-readable cause of a decision (also the ledger's denial reasons)."""

    FITS = "fits"
    FITS_AFTER_PREEMPTION = "fits_after_preemption"
    OVER_CLASS_LIMIT = "over_class_limit"
    LARGER_THAN_POOL = "larger_than_pool"
    NO_SLACK = "no_slack"
    """Batch: the slack outside the interactive reserve and interactive use is too small."""
    NO_ROOM = "no_room"
    """Interactive: the pool is full even counting what preempting batch would free."""
    TENANT_SHARE = "tenant_share"
    """Interactive: the tenant's leases on the node hold its share of the node already; it
    waits for its own leases to end, whatever room other tenants have."""
    LEDGER_REBUILDING = "ledger_rebuilding"
    """The ledger lost its data and is rebuilt from Postgres; batch admission is closed."""


REJECT_REASONS: frozenset[Reason] = frozenset({Reason.OVER_CLASS_LIMIT, Reason.LARGER_THAN_POOL})
"""Denials that will not change by waiting."""


@dataclass(frozen=True)
class ClassLimits:
    """Per-class limits that do not depend on load."""

    max_sequence_tokens: int
    """``prompt + max_output`` of one sequence may not exceed this."""

    def __post_init__(self) -> None:
        if self.max_sequence_tokens <= 0:
            raise ValueError("max_sequence_tokens must be positive")


@dataclass(frozen=True)
class PoolPolicy:
    """How one node's pool is shared between the classes."""

    interactive: ClassLimits = field(default_factory=lambda: ClassLimits(32_768))
    batch: ClassLimits = field(default_factory=lambda: ClassLimits(32_768))
    interactive_reserve_tokens: int | None = None
    """The reserve in tokens; or give ``interactive_reserve_fraction``; not both."""
    interactive_reserve_fraction: float | None = None
    """The reserve as a fraction of capacity (rounded up to whole tokens)."""
    headroom_tokens: int = 0
    """Room kept above current interactive use for its next burst, even beyond the reserve."""
    safety_margin_tokens: int = 0
    """Never handed to batch: covers estimate error (tokenizer drift, engine overhead)."""
    batch_overcommit: BatchOvercommit | None = None
    """Off unless set; applies to preemptible batch only."""
    defer_retry_after_s: float = 1.0
    """Hint given with a deferral."""

    def __post_init__(self) -> None:
        if self.interactive_reserve_fraction is not None:
            if self.interactive_reserve_tokens is not None:
                raise ValueError(
                    "give the interactive reserve as tokens or as a fraction, not both"
                )
        elif self.interactive_reserve_tokens is None:
            object.__setattr__(self, "interactive_reserve_tokens", 0)
        if self.interactive_reserve_tokens is not None and self.interactive_reserve_tokens < 0:
            raise ValueError("interactive_reserve_tokens must be >= 0")
        fraction = self.interactive_reserve_fraction
        if fraction is not None and not 0 <= fraction <= 1:
            raise ValueError("interactive_reserve_fraction must be in [0, 1]")
        if self.headroom_tokens < 0 or self.safety_margin_tokens < 0:
            raise ValueError("headroom_tokens and safety_margin_tokens must be >= 0")
        if self.defer_retry_after_s <= 0:
            raise ValueError("defer_retry_after_s must be positive")

    def limits(self, service_class: ServiceClass) -> ClassLimits:
        return self.interactive if service_class is ServiceClass.INTERACTIVE else self.batch

    def reserve_tokens(self, capacity_tokens: int) -> int:
        """R for a pool of ``capacity_tokens``."""
        if self.interactive_reserve_fraction is not None:
            return min(
                capacity_tokens, math.ceil(self.interactive_reserve_fraction * capacity_tokens)
            )
        return min(capacity_tokens, self.interactive_reserve_tokens or 0)


@dataclass(frozen=True)
class PoolState:
    """One node's pool as the ledger sees it at one instant."""

    capacity_tokens: int
    block_size: int
    interactive_in_use: int = 0
    batch_in_use: int = 0
    observed_non_batch: int = 0
    ready: bool = True
    """False while the ledger is rebuilt: batch is closed, interactive keeps the reserve."""

    @property
    def interactive_effective(self) -> int:
        return max(self.interactive_in_use, self.observed_non_batch)


@dataclass(frozen=True)
class AdmissionRequest:
    """The shape of a request, as the policy needs it."""

    service_class: ServiceClass
    prompt_tokens: int
    max_output_tokens: int
    n: int = 1
    preemptible: bool = True
    """Batch only: False once an item reached its preemption cap."""
    allow_preemption: bool = True
    """Interactive only: whether batch may be preempted to make room."""
    tenant_share_ppm: int | None = None
    """Interactive only: the millionths of the node's capacity its tenant's interactive
    leases may hold with it (:func:`tenant_share_tokens`); None: no bound."""

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


def charged_tokens(request: AdmissionRequest, block_size: int, policy: PoolPolicy) -> int:
    """The reservation the ledger takes for ``request`` (overcommit applied where allowed)."""
    max_output = request.max_output_tokens
    if (
        policy.batch_overcommit is not None
        and request.service_class is ServiceClass.BATCH
        and request.preemptible
    ):
        max_output = policy.batch_overcommit.charged_output(max_output)
    return reservation_tokens(request.prompt_tokens, max_output, block_size, request.n)


def tenant_share_ppm(share: float) -> int | None:
    """A tenant's share of a node (a fraction in (0, 1]) in millionths, as the ledger takes
    it; None for a share of 1, which bounds nothing."""
    if not 0 < share <= 1:
        raise ValueError("a tenant share must be in (0, 1]")
    ppm = min(PPM, max(1, round(share * PPM)))
    return None if ppm == PPM else ppm


def tenant_share_tokens(capacity_tokens: int, share_ppm: int) -> int:
    """The interactive tokens one tenant's leases may hold on a pool of ``capacity_tokens``
    (integer, so the reserve script computes the same bound bit for bit)."""
    return capacity_tokens * share_ppm // PPM


def batch_slack(state: PoolState, policy: PoolPolicy) -> int:
    """Tokens batch may reserve now."""
    c = state.capacity_tokens
    guarded = max(policy.reserve_tokens(c), state.interactive_effective + policy.headroom_tokens)
    return max(0, c - guarded - state.batch_in_use - policy.safety_margin_tokens)


def batch_ceiling(capacity_tokens: int, policy: PoolPolicy) -> int:
    """The most batch could ever hold on this pool (with no interactive use at all)."""
    c = capacity_tokens
    guarded = max(policy.reserve_tokens(c), policy.headroom_tokens)
    return max(0, c - guarded - policy.safety_margin_tokens)


def interactive_room(state: PoolState, policy: PoolPolicy) -> int:
    """Tokens interactive may reserve now without preempting: ``C - I - B``.

    Engine-observed use does not shrink it: interactive is the protected class, and the
    engine's priority scheduling absorbs traffic the gateway did not see.
    """
    del policy  # the same for every policy; kept so callers pass state and policy alike
    return max(0, state.capacity_tokens - state.interactive_in_use - state.batch_in_use)


class VictimCandidate(Protocol):
    """What the victim chooser needs to know about a live lease."""

    @property
    def lease_id(self) -> str: ...
    @property
    def service_class(self) -> ServiceClass: ...
    @property
    def tokens(self) -> int: ...
    @property
    def generated_tokens(self) -> int: ...
    @property
    def started_at_ms(self) -> int: ...
    @property
    def deadline_ms(self) -> int | None: ...
    @property
    def preemptible(self) -> bool: ...


V = TypeVar("V", bound=VictimCandidate)


def victim_order_key(lease: VictimCandidate) -> tuple[int, float, int, str]:
    """Sort key: least generated work lost first; among equals, the latest deadline first
    (it can best afford a retry), then the most recently started, then by id."""
    deadline = math.inf if lease.deadline_ms is None else lease.deadline_ms
    return (lease.generated_tokens, -deadline, -lease.started_at_ms, lease.lease_id)


def choose_victims(leases: Iterable[V], tokens_needed: int) -> tuple[V, ...] | None:
    """Preemptible batch leases whose release frees at least ``tokens_needed``, or ``None``.

    Greedy in :func:`victim_order_key` order, then a pass from the most expensive pick back
    drops any victim the others already cover, so no lease is preempted for nothing.
    Non-preemptible leases (items at their preemption cap) are never chosen.
    """
    if tokens_needed <= 0:
        return ()
    pool = sorted(
        (x for x in leases if x.service_class is ServiceClass.BATCH and x.preemptible),
        key=victim_order_key,
    )
    chosen: list[V] = []
    freed = 0
    for lease in pool:
        if freed >= tokens_needed:
            break
        chosen.append(lease)
        freed += lease.tokens
    if freed < tokens_needed:
        return None
    for i in range(len(chosen) - 1, -1, -1):
        if freed - chosen[i].tokens >= tokens_needed:
            freed -= chosen[i].tokens
            del chosen[i]
    return tuple(chosen)


@dataclass(frozen=True)
class Decision:
    """What to do with one request, and why."""

    kind: DecisionKind
    code: Reason
    reason: str
    """For people: what was compared with what."""
    tokens: int
    """The reservation the request needs (0 when rejected before it was computed)."""
    retry_after_s: float | None = None
    victims: tuple[str, ...] = ()
    """Lease ids to preempt first (PREEMPT_THEN_ADMIT only)."""

    @property
    def admitted(self) -> bool:
        return self.kind in (DecisionKind.ADMIT, DecisionKind.PREEMPT_THEN_ADMIT)


def decide(
    request: AdmissionRequest,
    state: PoolState,
    policy: PoolPolicy,
    leases: Sequence[VictimCandidate] = (),
    *,
    tenant_in_use: int = 0,
) -> Decision:
    """Admit, defer, reject, or preempt-then-admit ``request`` on the pool in ``state``;
    ``tenant_in_use`` is what the interactive leases of the request's tenant hold on it."""
    cls = request.service_class
    limit = policy.limits(cls).max_sequence_tokens
    if request.sequence_tokens > limit:
        return Decision(
            DecisionKind.REJECT,
            Reason.OVER_CLASS_LIMIT,
            f"{cls} request of {request.sequence_tokens} tokens (prompt + max output) is over "
            f"the class limit of {limit}",
            0,
        )
    tokens = charged_tokens(request, state.block_size, policy)
    c = state.capacity_tokens
    ceiling = c if cls is ServiceClass.INTERACTIVE else batch_ceiling(c, policy)
    if tokens > ceiling:
        return Decision(
            DecisionKind.REJECT,
            Reason.LARGER_THAN_POOL,
            f"{cls} reservation of {tokens} tokens is larger than the {ceiling} this pool "
            f"could ever give {cls}",
            tokens,
        )
    share = request.tenant_share_ppm
    if cls is ServiceClass.INTERACTIVE and share is not None:
        # Before room and preemption: a tenant at its share waits for its own leases, and
        # preempts no batch for what it may not hold.
        bound = tenant_share_tokens(c, share)
        if tenant_in_use > 0 and tenant_in_use + tokens > bound:
            return Decision(
                DecisionKind.DEFER,
                Reason.TENANT_SHARE,
                f"interactive reservation of {tokens} with the {tenant_in_use} its tenant "
                f"holds on the node exceeds the tenant's share of {bound}",
                tokens,
                policy.defer_retry_after_s,
            )
    if cls is ServiceClass.BATCH:
        return _batch_decision(tokens, state, policy)
    return _interactive_decision(request, tokens, state, policy, leases)


def _batch_decision(tokens: int, state: PoolState, policy: PoolPolicy) -> Decision:
    """A batch reservation of ``tokens`` (under its class limit and ceiling): into the slack."""
    retry = policy.defer_retry_after_s
    if not state.ready:
        return Decision(
            DecisionKind.DEFER,
            Reason.LEDGER_REBUILDING,
            "the ledger is being rebuilt from Postgres; batch admission is closed",
            tokens,
            retry,
        )
    slack = batch_slack(state, policy)
    if tokens <= slack:
        return Decision(
            DecisionKind.ADMIT,
            Reason.FITS,
            f"batch reservation of {tokens} fits the slack of {slack}",
            tokens,
        )
    c = state.capacity_tokens
    return Decision(
        DecisionKind.DEFER,
        Reason.NO_SLACK,
        f"batch reservation of {tokens} exceeds the slack of {slack} (capacity {c}, "
        f"reserve {policy.reserve_tokens(c)}, interactive {state.interactive_effective}, batch "
        f"{state.batch_in_use})",
        tokens,
        retry,
    )


def _interactive_decision(
    request: AdmissionRequest,
    tokens: int,
    state: PoolState,
    policy: PoolPolicy,
    leases: Sequence[VictimCandidate],
) -> Decision:
    """An interactive reservation of ``tokens`` (under its class limit, the pool and its
    tenant's share): into its room, else after preempting batch that frees enough."""
    retry = policy.defer_retry_after_s
    if not state.ready:
        # Batch in use is unknown until the rebuild ends; batch was only ever admitted outside
        # the reserve, so the reserve itself is safe to hand out.
        reserve = policy.reserve_tokens(state.capacity_tokens)
        if state.interactive_in_use + tokens <= reserve:
            return Decision(
                DecisionKind.ADMIT,
                Reason.FITS,
                f"interactive reservation of {tokens} fits the reserve of {reserve} while the "
                "ledger is rebuilt",
                tokens,
            )
        return Decision(
            DecisionKind.DEFER,
            Reason.LEDGER_REBUILDING,
            f"interactive reservation of {tokens} exceeds what is left of the reserve "
            f"({reserve - state.interactive_in_use}) while the ledger is rebuilt",
            tokens,
            retry,
        )
    room = interactive_room(state, policy)
    if tokens <= room:
        return Decision(
            DecisionKind.ADMIT,
            Reason.FITS,
            f"interactive reservation of {tokens} fits the room of {room}",
            tokens,
        )
    needed = state.interactive_in_use + state.batch_in_use + tokens - state.capacity_tokens
    victims = choose_victims(leases, needed) if request.allow_preemption else None
    if victims is not None:
        return Decision(
            DecisionKind.PREEMPT_THEN_ADMIT,
            Reason.FITS_AFTER_PREEMPTION,
            f"interactive reservation of {tokens} exceeds the room of {room}; preempting "
            f"{len(victims)} batch lease(s) frees {sum(v.tokens for v in victims)} of the "
            f"{needed} needed",
            tokens,
            victims=tuple(v.lease_id for v in victims),
        )
    return Decision(
        DecisionKind.DEFER,
        Reason.NO_ROOM,
        f"interactive reservation of {tokens} exceeds the room of {room}, and preemptible "
        f"batch cannot free the {needed} needed",
        tokens,
        retry,
    )
