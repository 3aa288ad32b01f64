"""Every ledger operation, written once: a plan of steps that either ledger carries out.

Each function takes the namespace's :class:`~backfill.ledger.calls.LedgerCalls` first and
then the operation's own arguments, exactly as :class:`~backfill.ledger.Ledger` and
:class:`~backfill.ledger.AsyncLedger` expose it (see :mod:`backfill.ledger.binding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import TypeVar

from backfill import keys as lk
from backfill.errors import BackfillError, LedgerError
from backfill.ledger.calls import LedgerCalls, NoPoolDenial, decoded, plain_denial
from backfill.ledger.steps import Command, Commands, Pipelined, Plan, Scan, ScriptCall, by_node
from backfill.ledger.values import (
    ActiveLease,
    Denial,
    HeartbeatResult,
    HeldLease,
    Lease,
    LeaseStatus,
    PartialBatchError,
    PoolCounters,
    PoolSnapshot,
    PreemptResult,
    ReserveRequest,
    SettleResult,
)
from backfill.policy import PoolPolicy, ServiceClass

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Pools


def register_pool(
    calls: LedgerCalls,
    node: str,
    capacity_tokens: int,
    block_size: int,
    *,
    policy: PoolPolicy | None = None,
    epoch: int | None = None,
    reserve_tokens: int | None = None,
) -> Plan[int]:
    """Create or update ``node``'s pool; returns its epoch (0: none until a rebuild).

    A node the built ledger never held opens at once with the ledger's epoch. One it held
    whose pool is gone lost its keys (its shard lost data): it stays closed until a rebuild
    restores its leases, which ``is_ready`` reports as due.
    """
    ledger_epoch: int | None = None
    built = yield Command(("GET", calls.keys.built), _same)
    # Joined before its pool exists: should its shard lose the pool later, the member set (in
    # another slot) still says the node was held, and a lost pool never passes for a new one.
    joined = built is not None and bool((yield Command(("SADD", calls.keys.members, node), int)))
    if joined:
        ledger_epoch = int(built)
    try:
        epoch_now: int = yield calls.register_pool(
            node, capacity_tokens, block_size, policy, epoch, reserve_tokens, ledger_epoch
        )
    except LedgerError:
        # Refused before any write: no pool, so no member either. (Unreachable Redis leaves
        # the member: the pool may exist now, and at worst a rebuild is due.)
        if joined:
            yield Command(("SREM", calls.keys.members, node), int)
        raise
    return epoch_now


def observe(
    calls: LedgerCalls,
    node: str,
    observed_tokens: int,
    *,
    over_reserved_tokens: int | None = None,
    now_ms: int | None = None,
) -> Plan[int | None]:
    """Record engine-observed non-batch use, and what the engine held above the ledger's
    reservations where it was measured; returns the new batch slack (None: no pool)."""
    slack: int | None = yield calls.observe(node, observed_tokens, now_ms, over_reserved_tokens)
    return slack


def snapshot(
    calls: LedgerCalls, node: str, *, now_ms: int | None = None
) -> Plan[PoolSnapshot | None]:
    """``node``'s pool and live leases at one instant (None: no pool)."""
    found: PoolSnapshot | None = yield calls.snapshot(node, now_ms)
    return found


def counters(calls: LedgerCalls, node: str) -> Plan[PoolCounters]:
    """The node's denial and preemption counts (zeros for a node without a pool)."""
    raw = yield Command(("HGETALL", calls.keys.pool(node)), dict)
    fields = {decoded(name): decoded(value) for name, value in raw.items()}
    denials: dict[tuple[str, str], int] = {}
    for name, value in fields.items():
        if name.startswith("denied:"):
            _, service_class, reason = name.split(":", 2)
            denials[(service_class, reason)] = int(value)
    return PoolCounters(
        denials,
        int(fields.get("preemptions", "0")),
        int(fields.get("owners_recounted", "0")),
        int(fields.get("over_reserved_samples", "0")),
        int(fields.get("over_reserved", "0")),
    )


def nodes(calls: LedgerCalls) -> Plan[list[str]]:
    """Every node with a pool in this namespace (on every shard of a cluster)."""
    found: list[str] = yield Scan(calls.keys.pool_pattern)
    return sorted(calls.keys.node_from_pool_key(k) for k in found)


def is_ready(calls: LedgerCalls) -> Plan[bool]:
    """False after Redis (or any shard of a cluster) lost the ledger's data, until a rebuild
    finishes: the ledger is built and every node it holds still has its ready marker."""
    missing = yield from incomplete_nodes(calls)
    return missing is not None and not missing


def incomplete_nodes(calls: LedgerCalls) -> Plan[frozenset[str] | None]:
    """The nodes a rebuild must restore: None when the ledger itself was lost (no built
    marker: every node), else the members whose ready marker is gone (a lost lease closed
    them, or their shard lost its data); empty when the ledger is intact. The members'
    markers are read in one round trip, however many nodes the fleet has."""
    if not (yield Command(("EXISTS", calls.keys.built), bool)):
        return None
    members: set[bytes] = yield Command(("SMEMBERS", calls.keys.members), set)
    nodes = sorted(decoded(m) for m in members)
    ready: list[bool] = yield Commands(
        [Command(("EXISTS", calls.keys.node(node).ready), bool) for node in nodes]
    )
    return frozenset(node for node, up in zip(nodes, ready, strict=True) if not up)


def mark_incomplete(calls: LedgerCalls, node: str) -> Plan[bool]:
    """Close batch admission on ``node`` until a rebuild: its ledger lacks a lease that a
    holder still holds (heartbeat ``unknown``), as when a replica took over from a master
    before every write had reached it. ``is_ready`` then reports the rebuild due, and the
    rebuild restores the lease from Postgres under a new epoch. The node is made a member of
    the ledger as well (a rebuild racing its first registration may have left it out), so
    ``is_ready`` sees it closed. Returns whether the node was open."""
    closed: int = yield Command(("DEL", calls.keys.node(node).ready), int)
    yield Command(("SADD", calls.keys.members, node), int)
    return bool(closed)


def unplaced(
    calls: LedgerCalls, results: Sequence[Lease | Denial]
) -> Plan[list[Lease | Denial | LedgerError]]:
    """``results`` with each :class:`NoPoolDenial` resolved: an error for a node the built
    ledger does not hold (as a script refuses an unknown node), else a ``ledger_rebuilding``
    denial (the node's keys were lost, or the ledger is being built)."""
    nodes = sorted({r.node for r in results if isinstance(r, NoPoolDenial)})
    if not nodes:
        return list(results)
    built: bool = yield Command(("EXISTS", calls.keys.built), bool)
    unknown: set[str] = set()
    for node in nodes:
        if built and not (yield Command(("SISMEMBER", calls.keys.members, node), bool)):
            unknown.add(node)
    out: list[Lease | Denial | LedgerError] = []
    for r in results:
        if isinstance(r, NoPoolDenial):
            out.append(
                LedgerError("backfill: unknown node") if r.node in unknown else plain_denial(r)
            )
        else:
            out.append(r)
    return out


# ---------------------------------------------------------------------------------------------
# Leases


def reserve(
    calls: LedgerCalls,
    node: str,
    service_class: ServiceClass | str,
    prompt_tokens: int,
    max_output_tokens: int,
    *,
    n: int = 1,
    lease_id: str | None = None,
    owner: str = "",
    preemptible: bool = True,
    deadline_ms: int | None = None,
    allow_preemption: bool = True,
    ttl_ms: int | None = None,
    tenant_share_ppm: int | None = None,
    now_ms: int | None = None,
) -> Plan[Lease | Denial]:
    """Reserve on ``node`` per the policy, or say why not."""
    req = ReserveRequest(
        node,
        ServiceClass(service_class),
        prompt_tokens,
        max_output_tokens,
        n=n,
        owner=owner,
        preemptible=preemptible,
        deadline_ms=deadline_ms,
        allow_preemption=allow_preemption,
        ttl_ms=ttl_ms,
        tenant_share_ppm=tenant_share_ppm,
    )
    if lease_id:
        req = replace(req, lease_id=lease_id)
    replies = yield calls.reserve(node, [req], now_ms)
    [result] = yield from unplaced(calls, replies)
    if isinstance(result, LedgerError):
        raise result
    decided: Lease | Denial = result
    return decided


def reserve_many(
    calls: LedgerCalls, requests: Sequence[ReserveRequest], *, now_ms: int | None = None
) -> Plan[list[Lease | Denial]]:
    """Reserve several in one round trip: one script call per node (and per chunk), each
    deciding its requests in order, atomically. Results come in request order."""
    groups = by_node(requests, lambda r: r.node)
    replies: list[Lease | Denial] = yield Pipelined[Lease | Denial](
        [calls.reserve(node, [requests[i] for i in idx], now_ms) for node, idx in groups],
        groups,
        len(requests),
    )
    decided = yield from unplaced(calls, replies)
    errors = [r for r in decided if isinstance(r, LedgerError)]
    if errors:
        raise PartialBatchError(
            f"{len(errors)} of {len(decided)} requests failed; first: {errors[0]}",
            list(decided),
        )
    return [r for r in decided if not isinstance(r, LedgerError)]


def settle(
    calls: LedgerCalls,
    node: str,
    lease_id: str,
    fencing_token: int,
    generated_tokens: int,
    *,
    reservation_tokens: int | None = None,
    now_ms: int | None = None,
) -> Plan[SettleResult]:
    """Record tokens generated so far; optionally shrink (never grow) the reservation."""
    result: SettleResult = yield calls.settle(
        node, lease_id, fencing_token, generated_tokens, reservation_tokens, now_ms
    )
    return result


def _as_batch(call: ScriptCall[T]) -> ScriptCall[list[T]]:
    """A one-result call as a pipelined batch's call (whose replies parse to lists)."""

    def parse(reply: object) -> list[T]:
        return [call.parse(reply)]

    return ScriptCall(call.script, call.keys, call.args, parse)


def settle_many(
    calls: LedgerCalls,
    node: str,
    progress: Sequence[tuple[str, int, int]],
    *,
    now_ms: int | None = None,
) -> Plan[list[SettleResult]]:
    """Record the progress of several of ``node``'s leases, each ``(lease_id, fencing_token,
    generated_tokens)``, in one round trip: one ``settle`` call per lease, pipelined, so a
    worker reports its node's progress once per interval instead of once per lease per few
    tokens. Results come in ``progress`` order; a failed call raises ``PartialBatchError``."""
    calls_one = [
        calls.settle(node, lease_id, fence, generated, None, now_ms)
        for lease_id, fence, generated in progress
    ]
    batched = [_as_batch(c) for c in calls_one]
    settled: list[SettleResult] = yield Pipelined[SettleResult](
        batched, [(node, [i]) for i in range(len(batched))], len(batched)
    )
    return settled


def heartbeat(
    calls: LedgerCalls,
    node: str,
    lease_id: str,
    fencing_token: int,
    *,
    ttl_ms: int | None = None,
    now_ms: int | None = None,
) -> Plan[HeartbeatResult]:
    """Extend the lease by ``ttl_ms`` (the ledger's lease TTL when None), or say why not."""
    result: HeartbeatResult = yield calls.heartbeat(node, lease_id, fencing_token, ttl_ms, now_ms)
    return result


def heartbeat_many(
    calls: LedgerCalls,
    node: str,
    held: Sequence[tuple[str, int]],
    *,
    ttl_ms: int | None = None,
    now_ms: int | None = None,
) -> Plan[list[HeartbeatResult | BackfillError]]:
    """Extend several of ``node``'s leases, each ``(lease_id, fencing_token)``, in one round
    trip (one ``heartbeat`` call per lease, pipelined): a worker's heartbeat of its node is
    one call per interval, not one per lease. Results come in ``held`` order; a call that
    failed is its error, so one bad lease does not hide the others' answers."""
    if not held:
        return []
    batched = [
        _as_batch(calls.heartbeat(node, lease_id, fence, ttl_ms, now_ms))
        for lease_id, fence in held
    ]
    try:
        beats: list[HeartbeatResult] = yield Pipelined[HeartbeatResult](
            batched, [(node, [i]) for i in range(len(batched))], len(batched)
        )
    except PartialBatchError as exc:
        return [
            r if isinstance(r, HeartbeatResult | BackfillError) else LedgerError(str(r))
            for r in exc.results
        ]
    return list(beats)


def restore_lease(calls: LedgerCalls, lease: Lease, *, ttl_ms: int, now_ms: int) -> Plan[bool]:
    """Put ``lease`` back into its node's ledger, which lost it (its heartbeat said
    ``unknown``), counted in its class's use and expiring ``ttl_ms`` after ``now_ms``: what an
    interactive lease's holder does, as a rebuild does for batch leases from Postgres. Only
    once the node's pool has an epoch above the lease's (a rebuild has begun): the script
    refuses a fencing token of the current epoch, with a :class:`LedgerError`. Returns
    whether it was put back (False: the ledger holds it, or it ended, already)."""
    held = ActiveLease(
        lease_id=lease.lease_id,
        node=lease.node,
        tokens=lease.tokens,
        fencing_token=lease.fencing_token,
        expires_at=datetime.fromtimestamp((now_ms + ttl_ms) / 1000, UTC),
        owner=lease.owner,
        preemptible=lease.preemptible,
        generated_tokens=lease.generated_tokens,
        started_at=datetime.fromtimestamp(lease.started_at_ms / 1000, UTC),
        service_class=lease.service_class,
        prefix_id=lease.prefix_id,
        prefix_tokens=lease.prefix_tokens,
    )
    restored, _ = yield calls.restore(lease.node, [held], now_ms)
    return bool(restored)


def release(calls: LedgerCalls, held: HeldLease, *, now_ms: int | None = None) -> Plan[LeaseStatus]:
    """Give the lease's tokens back (idempotent; a stale holder changes nothing)."""
    [status] = yield calls.release(held.node, [held], now_ms)
    released: LeaseStatus = status
    return released


def release_many(
    calls: LedgerCalls, held: Sequence[HeldLease], *, now_ms: int | None = None
) -> Plan[list[LeaseStatus]]:
    """Release several in one round trip; statuses come in the order given."""
    groups = by_node(held, lambda h: h.node)
    statuses: list[LeaseStatus] = yield Pipelined[LeaseStatus](
        [calls.release(node, [held[i] for i in idx], now_ms) for node, idx in groups],
        groups,
        len(held),
    )
    return statuses


def release_unconfirmed(
    calls: LedgerCalls, requests: Sequence[ReserveRequest], *, now_ms: int | None = None
) -> Plan[list[LeaseStatus]]:
    """Give back reservations whose answer was lost (a ``reserve_many`` that failed on its
    connection: Redis may have granted them), by lease id and owner, in one round trip;
    statuses come in request order. One never granted is refused should it still arrive."""
    groups = by_node(requests, lambda r: r.node)
    statuses: list[LeaseStatus] = yield Pipelined[LeaseStatus](
        [
            calls.release_unconfirmed(node, [requests[i] for i in idx], now_ms)
            for node, idx in groups
        ],
        groups,
        len(requests),
    )
    return statuses


def preempt(
    calls: LedgerCalls,
    node: str,
    tokens_needed: int,
    *,
    victims: Sequence[str] | None = None,
    now_ms: int | None = None,
) -> Plan[PreemptResult]:
    """Preempt batch on ``node`` to free ``tokens_needed`` and notify the victims."""
    result: PreemptResult = yield calls.preempt(node, tokens_needed, victims, now_ms)
    return result


def reap(
    calls: LedgerCalls, node: str, *, limit: int = lk.REAP_BATCH, now_ms: int | None = None
) -> Plan[list[str]]:
    """Reclaim expired leases on ``node``; returns their ids."""
    reaped: list[str] = yield calls.reap(node, limit, now_ms)
    return reaped


def reap_many(
    calls: LedgerCalls,
    nodes: Sequence[str],
    *,
    limit: int = lk.REAP_BATCH,
    now_ms: int | None = None,
) -> Plan[list[list[str]]]:
    """Reclaim expired leases on every node of ``nodes`` in one round trip (one script call
    a node, each atomic); returns each node's reaped lease ids, in ``nodes``' order. A node
    whose call failed raises :class:`PartialBatchError` after the rest were reaped."""
    groups = [(node, [i]) for i, node in enumerate(nodes)]
    reaped: list[list[str]] = yield Pipelined[list[str]](
        [_as_batch(calls.reap(node, limit, now_ms)) for node in nodes], groups, len(nodes)
    )
    return reaped


def _same(reply: object) -> object:
    return reply
