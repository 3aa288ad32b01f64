"""The ledger's values: leases, denials, what each call found, pools as Redis and Postgres
hold them. Plain frozen dataclasses; nothing here talks to Redis."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Protocol

from backfill.errors import LedgerError
from backfill.policy import PoolState, Reason, ServiceClass
from backfill.reservations import PPM


class LeaseStatus(StrEnum):
    """What a heartbeat, settle or release found."""

    OK = "ok"
    """Heartbeat or settle applied."""
    RELEASED = "released"
    """Release freed the lease's tokens now."""
    ALREADY_RELEASED = "already_released"
    """An earlier release freed them (release is idempotent)."""
    EXPIRED = "expired"
    """The lease ran past its TTL: its tokens are (or are about to be) reclaimed."""
    PREEMPTED = "preempted"
    """Interactive took the room; the holder must abort its engine request."""
    FENCED = "fenced"
    """The caller's fencing token does not hold this lease: it is a stale holder."""
    UNKNOWN = "unknown"
    """The ledger does not know the lease (never reserved, forgotten, or lost with Redis
    data and not yet restored by a rebuild)."""


@dataclass(frozen=True)
class Lease:
    """A live reservation on one node."""

    lease_id: str
    node: str
    service_class: ServiceClass
    tokens: int
    fencing_token: int
    expires_at_ms: int
    started_at_ms: int
    owner: str = ""
    preemptible: bool = True
    generated_tokens: int = 0
    deadline_ms: int | None = None
    preempted: tuple[str, ...] = ()
    """Batch leases preempted to admit this one (interactive only)."""
    prefix_id: str | None = None
    """The shared prompt prefix the lease refers to (its tokens are the node's, held once,
    not in ``tokens``)."""
    prefix_tokens: int = 0


@dataclass(frozen=True)
class Denial:
    """Why a reservation was refused, with the pool's figures at that moment."""

    node: str
    service_class: ServiceClass
    reason: Reason
    tokens: int
    """The reservation asked for (0 when refused before computing it)."""
    slack: int
    room: int
    retry_after_s: float | None
    """``None`` when waiting cannot help (over the class limit, or larger than the pool)."""
    tenant_in_use: int | None = None
    """``tenant_share`` only: what the owner's interactive leases hold on the node."""
    tenant_bound: int | None = None
    """``tenant_share`` only: what they may hold (the tenant's share of the node)."""

    @property
    def permanent(self) -> bool:
        return self.retry_after_s is None


@dataclass(frozen=True)
class HeartbeatResult:
    status: LeaseStatus
    expires_at_ms: int | None = None

    @property
    def ok(self) -> bool:
        return self.status is LeaseStatus.OK


@dataclass(frozen=True)
class SettleResult:
    status: LeaseStatus
    tokens: int | None = None
    """The reservation after settling."""
    generated_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status is LeaseStatus.OK


@dataclass(frozen=True)
class PreemptResult:
    victims: tuple[str, ...]
    freed_tokens: int
    """Tokens freed; when ``victims`` is empty because batch could not free enough, the tokens
    preemptible batch holds in all."""
    sufficient: bool


@dataclass(frozen=True)
class PrefixHold:
    """A shared prompt prefix a node holds once: its tokens, and the live leases that refer
    to it."""

    prefix_id: str
    tokens: int
    holders: int


@dataclass(frozen=True)
class PoolSnapshot:
    """One node's pool and live leases at one instant."""

    node: str
    now_ms: int
    ready: bool
    capacity_tokens: int
    block_size: int
    reserve_tokens: int
    headroom_tokens: int
    safety_margin_tokens: int
    max_sequence_interactive: int
    max_sequence_batch: int
    overcommit_ppm: int
    epoch: int
    observed_non_batch: int
    observed_at_ms: int
    interactive_in_use: int
    batch_in_use: int
    slack: int
    interactive_room: int
    fence_counter: int
    leases: tuple[Lease, ...]
    prefixes: tuple[PrefixHold, ...] = ()
    """The shared prompt prefixes the node holds (their tokens are in ``batch_in_use``)."""

    @property
    def prefix_tokens(self) -> int:
        return sum(p.tokens for p in self.prefixes)

    @property
    def reserved(self) -> int:
        return self.interactive_in_use + self.batch_in_use

    @property
    def state(self) -> PoolState:
        return PoolState(
            capacity_tokens=self.capacity_tokens,
            block_size=self.block_size,
            interactive_in_use=self.interactive_in_use,
            batch_in_use=self.batch_in_use,
            observed_non_batch=self.observed_non_batch,
            ready=self.ready,
        )


@dataclass(frozen=True)
class PoolCounters:
    """Monotonic counts a node's pool keeps for monitoring (reset only with its Redis data)."""

    denials: dict[tuple[str, str], int]
    """(service class, reason) -> reservations refused."""
    preemptions: int
    """Batch leases preempted to make room for interactive work."""
    owners_recounted: int = 0
    """Owners whose interactive count the periodic reap found off the live leases and put
    right (0 while every script counts them: a process on an older version wrote the ledger,
    or a bug)."""
    over_reserved_samples: int = 0
    """Samples of the engine's KV use in which it held more than the node's reservations
    (the invariant, checked physically: stays 0)."""
    over_reserved_tokens: int = 0
    """What the last sample found the engine holding above them."""


@dataclass(frozen=True)
class NodePool:
    """A node's measured pool, as Postgres records it (input to :meth:`Ledger.rebuild`)."""

    name: str
    capacity_tokens: int
    block_size: int
    interactive_reserve_tokens: int | None = None
    """Overrides the policy's reserve for this node when set."""


@dataclass(frozen=True)
class ActiveLease:
    """A lease known to be held outside the ledger, to restore into it: a batch lease Postgres
    holds (an item in state reserved or running), or an interactive lease its gateway holds."""

    lease_id: str
    node: str
    tokens: int
    fencing_token: int
    expires_at: datetime
    owner: str = ""
    preemptible: bool = True
    generated_tokens: int = 0
    started_at: datetime | None = None
    deadline: datetime | None = None
    service_class: ServiceClass = ServiceClass.BATCH
    prefix_id: str | None = None
    prefix_tokens: int = 0


@dataclass(frozen=True)
class RebuildReport:
    epoch: int
    """The epoch the rebuild used; the caller stores it and passes a larger one next time."""
    restored: int
    skipped: int
    unlisted: tuple[str, ...] = ()
    """Closed nodes with a pool that the rebuild was not given (registered while it ran, or
    unknown to Postgres): still members, so the next rebuild takes them."""


@dataclass(frozen=True)
class ReserveRequest:
    """One reservation, for :meth:`Ledger.reserve_many`."""

    node: str
    service_class: ServiceClass
    prompt_tokens: int
    max_output_tokens: int
    n: int = 1
    lease_id: str = field(default_factory=lambda: f"ls_{secrets.token_hex(10)}")
    owner: str = ""
    preemptible: bool = True
    deadline_ms: int | None = None
    allow_preemption: bool = True
    ttl_ms: int | None = None
    tenant_share_ppm: int | None = None
    """Interactive only: the millionths of the node's capacity that the interactive leases
    of ``owner`` (the gateway owns a tenant's as ``gateway/{tenant_id}``) may hold with this
    one (``backfill.policy.tenant_share_tokens``); None: no bound."""
    prefix_id: str | None = None
    """Batch only, one sequence: the shared prompt prefix the prompt starts with, held once
    on the node by every lease that refers to it (issue 36); None: the whole prompt is the
    lease's own."""
    prefix_tokens: int = 0
    """The prefix's tokens: whole blocks, below ``prompt_tokens``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "service_class", ServiceClass(self.service_class))
        share = self.tenant_share_ppm
        if share is not None and (
            not 1 <= share <= PPM or self.service_class is not ServiceClass.INTERACTIVE
        ):
            raise ValueError("tenant_share_ppm is 1..1,000,000, for interactive requests only")
        # max_output_tokens 0: an embedding, which holds its prompt alone.
        if (
            self.prompt_tokens < 0
            or self.max_output_tokens < 0
            or self.prompt_tokens + self.max_output_tokens < 1
            or self.n < 1
        ):
            raise ValueError(
                "need prompt_tokens >= 0, max_output_tokens >= 0, prompt + max_output >= 1, n >= 1"
            )
        if (self.prefix_id is None) != (self.prefix_tokens == 0):
            raise ValueError("a prefix_id goes with its prefix_tokens, and none without one")
        if self.prefix_id is not None and (
            self.service_class is not ServiceClass.BATCH
            or self.n != 1
            or not 0 < self.prefix_tokens < self.prompt_tokens
        ):
            raise ValueError(
                "a shared prefix is for a batch request of one sequence, shorter than its prompt"
            )


class HeldLease(Protocol):
    """What identifies a holder's lease (a :class:`Lease`, or fields read from Postgres)."""

    @property
    def node(self) -> str: ...
    @property
    def lease_id(self) -> str: ...
    @property
    def fencing_token(self) -> int: ...


@dataclass(frozen=True)
class LeaseRef:
    node: str
    lease_id: str
    fencing_token: int


class PartialBatchError(LedgerError):
    """Some calls of a pipelined batch failed; ``results`` holds each call's result or error
    so the caller can release what was admitted."""

    def __init__(self, message: str, results: list[object]) -> None:
        super().__init__(message)
        self.results = results
