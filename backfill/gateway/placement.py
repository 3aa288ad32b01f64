"""Where an interactive request is admitted: the serving nodes ranked by their load, and the
admission loop that reserves on the first node that admits the request, preempting batch
where that makes room, waiting within the caller's budget, then refusing with a retry hint.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from backfill.errors import BackfillError, LedgerError, LedgerUnavailable
from backfill.gateway.refusals import (
    ClientGone,
    ContextLengthExceeded,
    GatewayRefusal,
    GatewayUnavailable,
    NoInteractiveRoom,
    ReservationTooLarge,
    TenantShareExceeded,
)
from backfill.gateway.sizing import Sizing
from backfill.ledger import Denial, InteractiveLedger, Lease, PoolSnapshot
from backfill.policy import Reason, ServiceClass


@dataclass(frozen=True)
class NodeLoad:
    """One node's interactive headroom as its ledger snapshot shows it."""

    node: str
    ready: bool
    capacity_tokens: int
    interactive_room: int
    preemptible_batch: int
    """Tokens preempting batch could free."""
    pressure: float
    """Share of the pool held: interactive (reserved, or engine-observed non-batch use when
    that is larger, i.e. traffic that bypassed the gateway) plus batch."""


def node_load(snapshot: PoolSnapshot) -> NodeLoad:
    capacity = max(1, snapshot.capacity_tokens)
    held = max(snapshot.interactive_in_use, snapshot.observed_non_batch) + snapshot.batch_in_use
    preemptible = sum(
        lease.tokens
        for lease in snapshot.leases
        if lease.service_class is ServiceClass.BATCH and lease.preemptible
    )
    return NodeLoad(
        node=snapshot.node,
        ready=snapshot.ready,
        capacity_tokens=snapshot.capacity_tokens,
        interactive_room=snapshot.interactive_room,
        preemptible_batch=preemptible,
        pressure=min(1.0, held / capacity),
    )


def rank_nodes(loads: Sequence[NodeLoad], tokens: int) -> list[str]:
    """Nodes in the order to try a reservation of ``tokens``.

    First those where it fits without preempting anything, least pressed first (KV cache
    pressure slows every request on a node, not just new ones); then those where preempting
    batch makes room, least preemption first; then the rest, most room first (the ledger has
    the last word on each try).
    """

    def key(load: NodeLoad) -> tuple[int, float, int]:
        if load.ready and tokens <= load.interactive_room:
            return (0, load.pressure, -load.interactive_room)
        short = tokens - load.interactive_room
        if load.ready and short <= load.preemptible_batch:
            return (1, float(short), -load.interactive_room)
        return (2, 0.0, -load.interactive_room)

    return [load.node for load in sorted(loads, key=lambda x: (*key(x), x.node))]


def wait_budget_s(
    requested_s: float | None,
    default_s: float,
    client_read_timeout_s: float | None,
    cap_s: float = math.inf,
) -> float:
    """How long a request may wait for room: what the caller asked for (the gateway's header),
    else the deployment's default; never more than ``cap_s``, nor more than half of the
    client's own read timeout, so the answer (even a refusal) arrives before the client gives
    up."""
    budget = min(default_s if requested_s is None else requested_s, cap_s)
    if client_read_timeout_s is not None and client_read_timeout_s > 0:
        budget = min(budget, client_read_timeout_s / 2)
    return max(0.0, budget)


@dataclass(frozen=True)
class Admission:
    lease: Lease
    waited_s: float
    attempts: int


@dataclass(frozen=True)
class AdmissionTiming:
    first_backoff_s: float = 0.01
    max_backoff_s: float = 0.2
    retry_after_s: float = 1.0


async def admit(
    ledger: InteractiveLedger,
    nodes: Sequence[str],
    sizing: Sizing,
    *,
    lease_id: str,
    owner: str,
    ttl_ms: int,
    max_wait_s: float,
    timing: AdmissionTiming | None = None,
    disconnected: Callable[[], Awaitable[bool]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    allow_preemption: bool = True,
    tenant_share_ppm: int | None = None,
) -> Admission:
    """Reserve ``sizing`` on the first of ``nodes`` (ranked by load when there are several)
    that admits it, preempting batch where that makes room (unless ``allow_preemption`` is
    False); wait up to ``max_wait_s``. With ``tenant_share_ppm``, ``owner``'s interactive
    leases on a node may hold that share of it at most (a tenant's leases share an owner).

    Raises :class:`NoInteractiveRoom`, :class:`TenantShareExceeded` (the tenant holds its
    share of the nodes that had room) or :class:`GatewayUnavailable` (with a retry hint) when
    the wait runs out, :class:`ReservationTooLarge` when no node could ever hold it, and
    :class:`ClientGone` when ``disconnected`` says the caller left. Reserve is idempotent per
    lease id, so one id serves every try.
    """
    t = timing or AdmissionTiming()
    if not nodes:
        raise GatewayUnavailable("no node is registered for this model", retry_after_s=5.0)
    start = clock()
    deadline = start + max_wait_s
    backoff = t.first_backoff_s
    attempts = 0

    async def reserve(node: str) -> Lease | Denial:
        try:
            return await ledger.reserve(
                node,
                ServiceClass.INTERACTIVE,
                sizing.prompt_tokens,
                sizing.max_output_tokens,
                n=sizing.sequences,
                lease_id=lease_id,
                owner=owner,
                allow_preemption=allow_preemption,
                ttl_ms=ttl_ms,
                tenant_share_ppm=tenant_share_ppm,
            )
        except LedgerUnavailable as exc:
            raise GatewayUnavailable(
                f"the capacity ledger is unavailable: {exc}", retry_after_s=t.retry_after_s
            ) from exc

    while True:
        order = list(nodes)
        if len(order) > 1:
            order = await _ranked(ledger, order, sizing)
        denied = _Denials()
        for node in order:
            attempts += 1
            try:
                outcome = await reserve(node)
            except LedgerError as exc:
                # A node in Postgres whose pool the ledger does not (yet) know.
                denied.reasons.add(f"{node}: {exc}")
                continue
            if isinstance(outcome, Lease):
                return Admission(outcome, clock() - start, attempts)
            denied.add(outcome)
        if denied.permanent and len(denied.permanent) == len(order):
            raise _permanent_refusal(denied.permanent[-1], sizing)
        now = clock()
        if now >= deadline:
            raise _refusal_after_wait(denied, sizing, now - start, max(t.retry_after_s, 1.0))
        if disconnected is not None and await disconnected():
            raise ClientGone("the caller disconnected while waiting for room")
        await asyncio.sleep(min(backoff, deadline - now))
        backoff = min(backoff * 2, t.max_backoff_s)


@dataclass
class _Denials:
    """One pass over the nodes that admitted nothing: why each refused."""

    permanent: list[Denial] = field(default_factory=list)
    reasons: set[str] = field(default_factory=set)
    share: Denial | None = None
    """A node's refusal for the tenant's share (the last one seen)."""

    def add(self, denial: Denial) -> None:
        self.reasons.add(denial.reason.value)
        if denial.reason is Reason.TENANT_SHARE:
            self.share = denial
        if denial.permanent:
            self.permanent.append(denial)


def _refusal_after_wait(
    denied: _Denials, sizing: Sizing, waited_s: float, retry_after_s: float
) -> GatewayRefusal:
    """Why the wait ran out, from the last pass's denials."""
    share, reasons = denied.share, denied.reasons
    if share is not None and reasons <= {Reason.NO_ROOM.value, share.reason.value}:
        # Its own leases hold the tenant back where others' left room.
        return TenantShareExceeded(
            f"Your interactive requests hold {share.tenant_in_use} of the "
            f"{share.tenant_bound} KV tokens one tenant may hold on node {share.node} "
            f"(BACKFILL_GATEWAY_TENANT_SHARE), and {sizing.sequences} x "
            f"{sizing.sequence_tokens} more do not fit under it; waited "
            f"{waited_s:.2f} s for your own requests to end. Retry after the time "
            "in Retry-After.",
            retry_after_s=retry_after_s,
        )
    if reasons <= {Reason.NO_ROOM.value}:
        return NoInteractiveRoom(
            f"No node serving this model has room for {sizing.sequences} x "
            f"{sizing.sequence_tokens} tokens now, even after preempting batch work; "
            f"waited {waited_s:.2f} s. Retry after the time in Retry-After.",
            retry_after_s=retry_after_s,
        )
    return GatewayUnavailable(
        f"Cannot admit interactive requests now ({', '.join(sorted(reasons))}); "
        "retry after the time in Retry-After.",
        retry_after_s=retry_after_s,
    )


def _permanent_refusal(denial: Denial, sizing: Sizing) -> GatewayRefusal:
    if denial.reason is Reason.OVER_CLASS_LIMIT:
        return ContextLengthExceeded(
            f"prompt + max output ({sizing.sequence_tokens} tokens) is over the interactive "
            "class limit of the serving nodes",
            stage="exact",
            limit=None,
            param=None,
        )
    return ReservationTooLarge(
        f"the request needs {denial.tokens} KV tokens ({sizing.sequences} sequence(s) of "
        f"{sizing.sequence_tokens}), more than any serving node's pool could ever hold; "
        "lower n or max_tokens"
    )


async def _ranked(ledger: InteractiveLedger, nodes: Sequence[str], sizing: Sizing) -> list[str]:
    try:
        snaps = await asyncio.gather(*(ledger.snapshot(n) for n in nodes))
    except BackfillError:
        return list(nodes)
    loads = [node_load(s) for s in snaps if s is not None]
    tokens = sizing.sequences * sizing.sequence_tokens
    ranked = rank_nodes(loads, tokens)
    # Nodes the ledger has no pool for go last: reserve will say why.
    return ranked + [n for n in nodes if n not in ranked]
