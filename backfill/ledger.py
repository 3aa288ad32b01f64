"""The KV-token ledger: one interface over the Lua scripts in ``backfill/lua/``.

Every change to the live ledger is one script call, atomic in Redis. This module builds each
call's KEYS and ARGV, runs it (singly or pipelined), and turns the reply into typed values.
Redis errors become :class:`~backfill.errors.LedgerUnavailable`, script refusals
:class:`~backfill.errors.LedgerError`, here and nowhere else.

Holders use leases in ``try/finally``: reserve, do the work, release. ``reserve`` is
idempotent per lease id, so after a connection error a retry with the same id cannot take the
tokens twice. Preemption reaches a holder twice: as a pub/sub notice
(:meth:`Ledger.listen_preemptions`), and, should the notice be lost, as the status of its next
heartbeat.

Redis is not durable. When it loses its data the ready marker is gone with it, batch admission
closes (denial reason ``ledger_rebuilding``), and :meth:`Ledger.rebuild` restores the pools and
live batch leases from records read from Postgres, then reopens admission.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Any, Protocol, TypeVar

import redis
import redis.asyncio
from redis.exceptions import NoScriptError, ResponseError

from backfill import keys as lk
from backfill.errors import LedgerError, LedgerUnavailable
from backfill.policy import PoolPolicy, PoolState, Reason, ServiceClass

T = TypeVar("T")

SCRIPTS = (
    "register_pool", "reserve", "settle", "heartbeat", "release", "preempt", "reap",
    "snapshot", "observe", "restore",
)


@cache
def script_source(name: str) -> str:
    """The full source of one ledger script: constants, shared helpers, then the script."""
    if name not in SCRIPTS:
        raise ValueError(f"no ledger script {name!r}")
    folder = resources.files("backfill") / "lua"
    prelude = (
        f"local SHIFT, MAX_INT, MAX_EPOCH, PPM, ENDED_TTL_MS, REAP_IN_RESERVE = "
        f"{lk.FENCE_EPOCH_SHIFT}, {lk.MAX_INT}, {lk.MAX_EPOCH}, 1000000, {lk.ENDED_TTL_MS}, "
        f"{lk.REAP_IN_RESERVE}\n"
    )
    lib = (folder / "_lib.lua").read_text(encoding="utf-8")
    body = (folder / f"{name}.lua").read_text(encoding="utf-8")
    return f"{prelude}{lib}\n{body}"


# ---------------------------------------------------------------------------------------------
# Values


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
    """A batch lease Postgres knows to be held (an item in state reserved or running)."""

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


@dataclass(frozen=True)
class RebuildReport:
    epoch: int
    """The epoch the rebuild used; the caller stores it and passes a larger one next time."""
    restored: int
    skipped: int


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "service_class", ServiceClass(self.service_class))
        if self.prompt_tokens < 0 or self.max_output_tokens < 1 or self.n < 1:
            raise ValueError("need prompt_tokens >= 0, max_output_tokens >= 1, n >= 1")


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


# ---------------------------------------------------------------------------------------------
# Calls: KEYS, ARGV and reply parsing, shared by the sync and async ledgers


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _ms(value: datetime | None) -> int:
    # Integer arithmetic: float timestamps lose the millisecond now and then.
    if value is None:
        return 0
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return (value - _EPOCH) // timedelta(milliseconds=1)


def _arg(value: int | None) -> str:
    return "" if value is None else str(value)


def _translate(exc: redis.RedisError) -> LedgerError | LedgerUnavailable:
    if isinstance(exc, ResponseError):
        message = str(exc).split(" script: ", 1)[0]
        return LedgerError(message)
    return LedgerUnavailable(f"Redis is unavailable: {exc}")


@dataclass(frozen=True)
class _Call:
    script: str
    keys: list[str]
    args: list[str]
    parse: Callable[[Any], Any]


class _Calls:
    def __init__(self, namespace: str, policy: PoolPolicy, lease_ttl_ms: int) -> None:
        self.keys = lk.LedgerKeys(namespace)
        self.policy = policy
        self.lease_ttl_ms = lease_ttl_ms

    def register_pool(
        self, node: str, capacity_tokens: int, block_size: int, policy: PoolPolicy | None,
        epoch: int | None, reserve_tokens: int | None = None,
    ) -> _Call:
        p = policy or self.policy
        reserve = p.reserve_tokens(capacity_tokens) if reserve_tokens is None else reserve_tokens
        ppm = p.batch_overcommit.output_ratio_ppm if p.batch_overcommit else 0
        args = [capacity_tokens, block_size, reserve, p.headroom_tokens, p.safety_margin_tokens,
                p.interactive.max_sequence_tokens, p.batch.max_sequence_tokens, ppm]
        return _Call("register_pool", self.keys.node(node).keys(),
                     [*map(str, args), _arg(epoch)], lambda r: int(r[1]))

    def reserve(self, node: str, reqs: Sequence[ReserveRequest], now_ms: int | None) -> _Call:
        nk = self.keys.node(node)
        args = [nk.channel, _arg(now_ms), str(len(reqs))]
        for req in reqs:
            ttl = req.ttl_ms if req.ttl_ms is not None else self.lease_ttl_ms
            args += [req.lease_id, req.service_class.value, str(req.prompt_tokens),
                     str(req.max_output_tokens), str(req.n), str(ttl), req.owner,
                     "1" if req.preemptible else "0", _arg(req.deadline_ms),
                     "1" if req.allow_preemption else "0"]
        retry = self.policy.defer_retry_after_s

        def parse_one(req: ReserveRequest, reply: list[Any]) -> Lease | Denial:
            if _s(reply[0]) == "denied":
                reason = Reason(_s(reply[1]))
                permanent = reason in (Reason.OVER_CLASS_LIMIT, Reason.LARGER_THAN_POOL)
                return Denial(node, req.service_class, reason, int(reply[2]), int(reply[3]),
                              int(reply[4]), None if permanent else retry)
            return Lease(
                lease_id=req.lease_id, node=node, service_class=req.service_class,
                tokens=int(reply[2]), fencing_token=int(reply[1]), expires_at_ms=int(reply[3]),
                started_at_ms=int(reply[4]), owner=req.owner, preemptible=req.preemptible,
                generated_tokens=int(reply[5]), deadline_ms=req.deadline_ms or None,
                preempted=tuple(_s(v) for v in reply[6]),
            )

        def parse(replies: list[Any]) -> list[Lease | Denial]:
            return [parse_one(q, r) for q, r in zip(reqs, replies, strict=True)]

        return _Call("reserve", nk.keys(), args, parse)

    def settle(self, node: str, lease_id: str, fencing_token: int, generated_tokens: int,
               reservation_tokens: int | None, now_ms: int | None) -> _Call:
        def parse(reply: list[Any]) -> SettleResult:
            status = LeaseStatus(_s(reply[0]))
            if status is LeaseStatus.OK:
                return SettleResult(status, int(reply[1]), int(reply[2]))
            return SettleResult(status)

        args = [_arg(now_ms), lease_id, str(fencing_token), str(generated_tokens),
                _arg(reservation_tokens)]
        return _Call("settle", self.keys.node(node).keys(), args, parse)

    def heartbeat(self, node: str, lease_id: str, fencing_token: int, ttl_ms: int | None,
                  now_ms: int | None) -> _Call:
        def parse(reply: list[Any]) -> HeartbeatResult:
            status = LeaseStatus(_s(reply[0]))
            return HeartbeatResult(status, int(reply[1]) if status is LeaseStatus.OK else None)

        ttl = self.lease_ttl_ms if ttl_ms is None else ttl_ms
        args = [_arg(now_ms), lease_id, str(fencing_token), str(ttl)]
        return _Call("heartbeat", self.keys.node(node).keys(), args, parse)

    def release(self, node: str, held: Sequence[HeldLease], now_ms: int | None) -> _Call:
        args = [_arg(now_ms), str(len(held))]
        for h in held:
            args += [h.lease_id, str(h.fencing_token)]
        return _Call("release", self.keys.node(node).keys(), args,
                     lambda r: [LeaseStatus(_s(x)) for x in r])

    def preempt(self, node: str, tokens_needed: int, victims: Sequence[str] | None,
                now_ms: int | None) -> _Call:
        nk = self.keys.node(node)

        def parse(reply: list[Any]) -> PreemptResult:
            return PreemptResult(tuple(_s(v) for v in reply[2]), int(reply[1]),
                                 _s(reply[0]) == "preempted")

        args = [nk.channel, _arg(now_ms), str(tokens_needed), *(victims or ())]
        return _Call("preempt", nk.keys(), args, parse)

    def reap(self, node: str, limit: int, now_ms: int | None) -> _Call:
        return _Call("reap", self.keys.node(node).keys(), [_arg(now_ms), str(limit)],
                     lambda r: [_s(v) for v in r])

    def observe(self, node: str, observed_tokens: int, now_ms: int | None) -> _Call:
        return _Call("observe", self.keys.node(node).keys(),
                     [_arg(now_ms), str(observed_tokens)],
                     lambda r: int(r[1]) if _s(r[0]) == "ok" else None)

    def snapshot(self, node: str, now_ms: int | None) -> _Call:
        def parse(r: list[Any]) -> PoolSnapshot | None:
            if not r:
                return None
            v = [int(x) for x in r[:18]]
            leases = tuple(_lease(node, x) for x in r[18])
            return PoolSnapshot(
                node, v[0], bool(v[1]), v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9],
                v[10], v[11], v[12], v[13], v[14], v[15], v[16], v[17], leases,
            )

        return _Call("snapshot", self.keys.node(node).keys(), [_arg(now_ms)], parse)

    def restore(self, node: str, leases: Sequence[ActiveLease], now_ms: int | None) -> _Call:
        args = [_arg(now_ms), str(len(leases))]
        for a in leases:
            args += [a.lease_id, str(a.tokens), str(a.fencing_token), str(_ms(a.expires_at)),
                     a.owner, "1" if a.preemptible else "0", str(a.generated_tokens),
                     str(_ms(a.started_at)), str(_ms(a.deadline))]
        return _Call("restore", self.keys.node(node).keys(), args,
                     lambda r: (int(r[0]), int(r[1])))


def _lease(node: str, r: Sequence[Any], preempted: tuple[str, ...] = ()) -> Lease:
    deadline = int(r[9])
    return Lease(
        lease_id=_s(r[0]), node=node, service_class=ServiceClass(_s(r[1])), tokens=int(r[2]),
        owner=_s(r[3]), fencing_token=int(r[4]), expires_at_ms=int(r[5]),
        preemptible=bool(int(r[6])), generated_tokens=int(r[7]), started_at_ms=int(r[8]),
        deadline_ms=deadline or None, preempted=preempted,
    )


def _rebuild_epoch(epoch: int, active: Sequence[ActiveLease], current: Sequence[int]) -> int:
    # Fences handed out after the rebuild must exceed every fence handed out before it: those
    # Postgres recorded, and those of epochs Redis advanced to on its own (counter overflow).
    highest = max([a.fencing_token // lk.FENCE_EPOCH_SHIFT for a in active] + list(current),
                  default=0)
    chosen = max(epoch, highest + 1)
    if chosen > lk.MAX_EPOCH:
        raise LedgerError(f"epoch {chosen} exceeds {lk.MAX_EPOCH}")
    return chosen


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _by_node(items: Sequence[T], node_of: Callable[[T], str]) -> list[tuple[str, list[int]]]:
    """Indices of ``items`` grouped by node (in order of first appearance), in chunks that keep
    each script call short."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(node_of(item), []).append(i)
    return [(node, list(chunk)) for node, idx in groups.items()
            for chunk in _chunks(idx, lk.BATCH_CHUNK)]


def _scatter(size: int, groups: list[tuple[str, list[int]]], results: list[Any]) -> list[Any]:
    out: list[Any] = [None] * size
    for (_, idx), result in zip(groups, results, strict=True):
        for j, i in enumerate(idx):
            out[i] = result if isinstance(result, Exception) else result[j]
    return out


# ---------------------------------------------------------------------------------------------
# The ledger


class Ledger:
    """The ledger over a synchronous redis-py client."""

    def __init__(
        self,
        client: redis.Redis,
        namespace: str,
        policy: PoolPolicy | None = None,
        lease_ttl_ms: int = 30_000,
    ) -> None:
        self._client = client
        self._calls = _Calls(namespace, policy or PoolPolicy(), lease_ttl_ms)
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPTS}

    @classmethod
    def from_url(cls, url: str, namespace: str, policy: PoolPolicy | None = None,
                 lease_ttl_ms: int = 30_000) -> Ledger:
        return cls(redis.Redis.from_url(url), namespace, policy, lease_ttl_ms)

    @property
    def keys(self) -> lk.LedgerKeys:
        return self._calls.keys

    @property
    def policy(self) -> PoolPolicy:
        return self._calls.policy

    @property
    def client(self) -> redis.Redis:
        """The Redis client, for the small non-ledger keys read beside it (work budget)."""
        return self._client

    def close(self) -> None:
        self._client.close()

    # -- running calls

    def _run(self, call: _Call) -> Any:
        try:
            reply = self._scripts[call.script](keys=call.keys, args=call.args)
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return call.parse(reply)

    def _run_many(self, calls: Sequence[_Call], groups: list[tuple[str, list[int]]],
                  size: int) -> list[Any]:
        if not calls:
            return []
        try:
            replies = self._pipeline(calls)
            missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if missing:
                # NOSCRIPT refuses a call before it runs, so running those again is safe.
                for name in {calls[i].script for i in missing}:
                    self._client.script_load(script_source(name))
                again = self._pipeline([calls[i] for i in missing])
                for i, r in zip(missing, again, strict=True):
                    replies[i] = r
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return _parse_all(calls, replies, groups, size)

    def _pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for c in calls:
            pipe.evalsha(self._scripts[c.script].sha, len(c.keys), *c.keys, *c.args)
        return list(pipe.execute(raise_on_error=False))

    # -- pools

    def register_pool(self, node: str, capacity_tokens: int, block_size: int, *,
                      policy: PoolPolicy | None = None, epoch: int | None = None,
                      reserve_tokens: int | None = None) -> int:
        """Create or update ``node``'s pool; returns its epoch (0: none until a rebuild)."""
        return int(self._run(self._calls.register_pool(
            node, capacity_tokens, block_size, policy, epoch, reserve_tokens)))

    def observe(self, node: str, observed_tokens: int, *, now_ms: int | None = None) -> int | None:
        """Record engine-observed non-batch use; returns the new batch slack (None: no pool)."""
        result: int | None = self._run(self._calls.observe(node, observed_tokens, now_ms))
        return result

    def snapshot(self, node: str, *, now_ms: int | None = None) -> PoolSnapshot | None:
        result: PoolSnapshot | None = self._run(self._calls.snapshot(node, now_ms))
        return result

    def counters(self, node: str) -> PoolCounters:
        """The node's denial and preemption counts (zeros for a node without a pool)."""
        try:
            raw = self._client.hgetall(self.keys.pool(node))
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        fields = {_s(name): _s(value) for name, value in raw.items()}
        denials: dict[tuple[str, str], int] = {}
        for name, value in fields.items():
            if name.startswith("denied:"):
                _, service_class, reason = name.split(":", 2)
                denials[(service_class, reason)] = int(value)
        return PoolCounters(denials, int(fields.get("preemptions", "0")))

    def nodes(self) -> list[str]:
        """Every node with a pool in this namespace."""
        try:
            found = self._client.scan_iter(match=self.keys.pool_pattern, count=1000)
            return sorted(self.keys.node_from_pool_key(_s(k)) for k in found)
        except redis.RedisError as exc:
            raise _translate(exc) from exc

    # -- leases

    def reserve(self, node: str, service_class: ServiceClass | str, prompt_tokens: int,
                max_output_tokens: int, *, n: int = 1, lease_id: str | None = None,
                owner: str = "", preemptible: bool = True, deadline_ms: int | None = None,
                allow_preemption: bool = True, ttl_ms: int | None = None,
                now_ms: int | None = None) -> Lease | Denial:
        """Reserve on ``node`` per the policy, or say why not."""
        req = ReserveRequest(
            node, ServiceClass(service_class), prompt_tokens, max_output_tokens, n=n,
            owner=owner, preemptible=preemptible, deadline_ms=deadline_ms,
            allow_preemption=allow_preemption, ttl_ms=ttl_ms,
            **({"lease_id": lease_id} if lease_id else {}),
        )
        result: Lease | Denial = self._run(self._calls.reserve(node, [req], now_ms))[0]
        return result

    def reserve_many(self, requests: Sequence[ReserveRequest], *,
                     now_ms: int | None = None) -> list[Lease | Denial]:
        """Reserve several in one round trip: one script call per node (and per chunk), each
        deciding its requests in order, atomically. Results come in request order."""
        groups = _by_node(requests, lambda r: r.node)
        calls = [self._calls.reserve(node, [requests[i] for i in idx], now_ms)
                 for node, idx in groups]
        return self._run_many(calls, groups, len(requests))

    def settle(self, node: str, lease_id: str, fencing_token: int, generated_tokens: int, *,
               reservation_tokens: int | None = None,
               now_ms: int | None = None) -> SettleResult:
        """Record tokens generated so far; optionally shrink (never grow) the reservation."""
        result: SettleResult = self._run(self._calls.settle(
            node, lease_id, fencing_token, generated_tokens, reservation_tokens, now_ms))
        return result

    def heartbeat(self, node: str, lease_id: str, fencing_token: int, *,
                  ttl_ms: int | None = None, now_ms: int | None = None) -> HeartbeatResult:
        result: HeartbeatResult = self._run(
            self._calls.heartbeat(node, lease_id, fencing_token, ttl_ms, now_ms))
        return result

    def release(self, held: HeldLease, *, now_ms: int | None = None) -> LeaseStatus:
        """Give the lease's tokens back (idempotent; a stale holder changes nothing)."""
        result: LeaseStatus = self._run(self._calls.release(held.node, [held], now_ms))[0]
        return result

    def release_many(self, held: Sequence[HeldLease], *,
                     now_ms: int | None = None) -> list[LeaseStatus]:
        """Release several in one round trip; statuses come in the order given."""
        groups = _by_node(held, lambda h: h.node)
        calls = [self._calls.release(node, [held[i] for i in idx], now_ms)
                 for node, idx in groups]
        return self._run_many(calls, groups, len(held))

    def preempt(self, node: str, tokens_needed: int, *, victims: Sequence[str] | None = None,
                now_ms: int | None = None) -> PreemptResult:
        """Preempt batch on ``node`` to free ``tokens_needed`` and notify the victims."""
        result: PreemptResult = self._run(
            self._calls.preempt(node, tokens_needed, victims, now_ms))
        return result

    def reap(self, node: str, *, limit: int = lk.REAP_BATCH,
             now_ms: int | None = None) -> list[str]:
        """Reclaim expired leases on ``node``; returns their ids."""
        result: list[str] = self._run(self._calls.reap(node, limit, now_ms))
        return result

    # -- readiness and rebuild

    def is_ready(self) -> bool:
        """False after Redis lost its data, until a rebuild finishes."""
        try:
            return bool(self._client.exists(self.keys.ready))
        except redis.RedisError as exc:
            raise _translate(exc) from exc

    def rebuild(self, nodes: Sequence[NodePool], active_leases: Sequence[ActiveLease],
                epoch: int, *, now_ms: int | None = None) -> RebuildReport:
        """Restore pools and live batch leases from Postgres records, then reopen batch.

        Batch admission is closed first and stays closed until every lease is back, so no
        batch lease is admitted against a ledger that is missing some. Interactive may use its
        reserve meanwhile. ``epoch`` must be larger than any epoch used before (the caller
        keeps it in Postgres); the epoch actually used is returned, possibly larger.
        """
        unknown = {a.node for a in active_leases} - {n.name for n in nodes}
        if unknown:
            raise LedgerError(f"active leases on nodes with no pool record: {sorted(unknown)}")
        try:
            self._client.delete(self.keys.ready)
            current = [int(e) for e in (self._client.hget(self.keys.pool(n.name), "epoch")
                                        for n in nodes) if e is not None]
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        chosen = _rebuild_epoch(epoch, active_leases, current)
        for n in nodes:
            self.register_pool(n.name, n.capacity_tokens, n.block_size, epoch=chosen,
                               reserve_tokens=n.interactive_reserve_tokens)
        restored = skipped = 0
        for n in nodes:
            mine = [a for a in active_leases if a.node == n.name]
            for chunk in _chunks(mine, lk.RESTORE_CHUNK):
                r, s = self._run(self._calls.restore(n.name, chunk, now_ms))
                restored += r
                skipped += s
        try:
            self._client.set(self.keys.ready, str(chosen))
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return RebuildReport(chosen, restored, skipped)

    # -- preemption notices

    def listen_preemptions(self, node: str) -> PreemptionListener:
        """A subscription to ``node``'s preempt channel, already subscribed when returned."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(self.keys.preempt_channel(node))
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return PreemptionListener(pubsub)


def _parse_all(calls: Sequence[_Call], replies: Sequence[Any],
               groups: list[tuple[str, list[int]]], size: int) -> list[Any]:
    """Each call's parsed results, scattered back to request order; raises
    :class:`PartialBatchError` (with every request's result or error) if any call failed."""
    per_call: list[Any] = []
    failed = 0
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, redis.RedisError):
            per_call.append(_translate(reply))
            failed += 1
        else:
            per_call.append(call.parse(reply))
    results = _scatter(size, groups, per_call)
    if failed:
        first = next(r for r in per_call if isinstance(r, Exception))
        raise PartialBatchError(f"{failed} of {len(calls)} calls failed; first: {first}", results)
    return results


class PreemptionListener:
    """Lease ids preempted on one node, as they are published."""

    def __init__(self, pubsub: redis.client.PubSub) -> None:
        self._pubsub = pubsub

    def get(self, timeout: float = 1.0) -> str | None:
        """The next preempted lease id, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                # get_message answers None for a subscribe confirmation too: wait on.
                message = self._pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
                if message is not None:
                    return _s(message["data"])
                if time.monotonic() >= deadline:
                    return None
        except redis.RedisError as exc:
            raise _translate(exc) from exc

    def __iter__(self) -> Iterator[str]:
        while True:
            lease_id = self.get(timeout=1.0)
            if lease_id is not None:
                yield lease_id

    def close(self) -> None:
        self._pubsub.close()

    def __enter__(self) -> PreemptionListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncLedger:
    """The same ledger over ``redis.asyncio`` (for the asyncio worker): same scripts, same
    values. Rebuild is left to the synchronous :class:`Ledger` (a maintenance task)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        namespace: str,
        policy: PoolPolicy | None = None,
        lease_ttl_ms: int = 30_000,
    ) -> None:
        self._client = client
        self._calls = _Calls(namespace, policy or PoolPolicy(), lease_ttl_ms)
        self._scripts = {name: client.register_script(script_source(name)) for name in SCRIPTS}

    @classmethod
    def from_url(cls, url: str, namespace: str, policy: PoolPolicy | None = None,
                 lease_ttl_ms: int = 30_000) -> AsyncLedger:
        return cls(redis.asyncio.Redis.from_url(url), namespace, policy, lease_ttl_ms)

    @property
    def keys(self) -> lk.LedgerKeys:
        return self._calls.keys

    @property
    def client(self) -> redis.asyncio.Redis:
        """The Redis client, for the small non-ledger keys used beside it (work budget)."""
        return self._client

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _run(self, call: _Call) -> Any:
        try:
            reply = await self._scripts[call.script](keys=call.keys, args=call.args)
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return call.parse(reply)

    async def _pipeline(self, calls: Sequence[_Call]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for c in calls:
            pipe.evalsha(self._scripts[c.script].sha, len(c.keys), *c.keys, *c.args)
        return list(await pipe.execute(raise_on_error=False))

    async def _run_many(self, calls: Sequence[_Call], groups: list[tuple[str, list[int]]],
                        size: int) -> list[Any]:
        if not calls:
            return []
        try:
            replies = await self._pipeline(calls)
            missing = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if missing:
                for name in {calls[i].script for i in missing}:
                    await self._client.script_load(script_source(name))
                again = await self._pipeline([calls[i] for i in missing])
                for i, r in zip(missing, again, strict=True):
                    replies[i] = r
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return _parse_all(calls, replies, groups, size)

    async def register_pool(self, node: str, capacity_tokens: int, block_size: int, *,
                            policy: PoolPolicy | None = None, epoch: int | None = None,
                            reserve_tokens: int | None = None) -> int:
        return int(await self._run(self._calls.register_pool(
            node, capacity_tokens, block_size, policy, epoch, reserve_tokens)))

    async def observe(self, node: str, observed_tokens: int, *,
                      now_ms: int | None = None) -> int | None:
        result: int | None = await self._run(self._calls.observe(node, observed_tokens, now_ms))
        return result

    async def snapshot(self, node: str, *, now_ms: int | None = None) -> PoolSnapshot | None:
        result: PoolSnapshot | None = await self._run(self._calls.snapshot(node, now_ms))
        return result

    async def reserve(self, node: str, service_class: ServiceClass | str, prompt_tokens: int,
                      max_output_tokens: int, *, n: int = 1, lease_id: str | None = None,
                      owner: str = "", preemptible: bool = True, deadline_ms: int | None = None,
                      allow_preemption: bool = True, ttl_ms: int | None = None,
                      now_ms: int | None = None) -> Lease | Denial:
        req = ReserveRequest(
            node, ServiceClass(service_class), prompt_tokens, max_output_tokens, n=n,
            owner=owner, preemptible=preemptible, deadline_ms=deadline_ms,
            allow_preemption=allow_preemption, ttl_ms=ttl_ms,
            **({"lease_id": lease_id} if lease_id else {}),
        )
        result: Lease | Denial = (await self._run(self._calls.reserve(node, [req], now_ms)))[0]
        return result

    async def reserve_many(self, requests: Sequence[ReserveRequest], *,
                           now_ms: int | None = None) -> list[Lease | Denial]:
        groups = _by_node(requests, lambda r: r.node)
        calls = [self._calls.reserve(node, [requests[i] for i in idx], now_ms)
                 for node, idx in groups]
        return await self._run_many(calls, groups, len(requests))

    async def settle(self, node: str, lease_id: str, fencing_token: int, generated_tokens: int,
                     *, reservation_tokens: int | None = None,
                     now_ms: int | None = None) -> SettleResult:
        result: SettleResult = await self._run(self._calls.settle(
            node, lease_id, fencing_token, generated_tokens, reservation_tokens, now_ms))
        return result

    async def heartbeat(self, node: str, lease_id: str, fencing_token: int, *,
                        ttl_ms: int | None = None,
                        now_ms: int | None = None) -> HeartbeatResult:
        result: HeartbeatResult = await self._run(
            self._calls.heartbeat(node, lease_id, fencing_token, ttl_ms, now_ms))
        return result

    async def release(self, held: HeldLease, *, now_ms: int | None = None) -> LeaseStatus:
        result: LeaseStatus = (await self._run(self._calls.release(held.node, [held], now_ms)))[0]
        return result

    async def release_many(self, held: Sequence[HeldLease], *,
                           now_ms: int | None = None) -> list[LeaseStatus]:
        groups = _by_node(held, lambda h: h.node)
        calls = [self._calls.release(node, [held[i] for i in idx], now_ms)
                 for node, idx in groups]
        return await self._run_many(calls, groups, len(held))

    async def preempt(self, node: str, tokens_needed: int, *,
                      victims: Sequence[str] | None = None,
                      now_ms: int | None = None) -> PreemptResult:
        result: PreemptResult = await self._run(
            self._calls.preempt(node, tokens_needed, victims, now_ms))
        return result

    async def reap(self, node: str, *, limit: int = lk.REAP_BATCH,
                   now_ms: int | None = None) -> list[str]:
        result: list[str] = await self._run(self._calls.reap(node, limit, now_ms))
        return result

    async def is_ready(self) -> bool:
        try:
            return bool(await self._client.exists(self.keys.ready))
        except redis.RedisError as exc:
            raise _translate(exc) from exc

    async def listen_preemptions(self, node: str) -> AsyncPreemptionListener:
        """A subscription to ``node``'s preempt channel, already subscribed when returned."""
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self.keys.preempt_channel(node))
        except redis.RedisError as exc:
            raise _translate(exc) from exc
        return AsyncPreemptionListener(pubsub)


class AsyncPreemptionListener:
    """Lease ids preempted on one node, as they are published (asyncio)."""

    def __init__(self, pubsub: redis.asyncio.client.PubSub) -> None:
        self._pubsub = pubsub

    async def get(self, timeout: float = 1.0) -> str | None:
        """The next preempted lease id, or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                message = await self._pubsub.get_message(
                    ignore_subscribe_messages=True,
                    timeout=max(0.0, deadline - time.monotonic()))
                if message is not None:
                    return _s(message["data"])
                if time.monotonic() >= deadline:
                    return None
        except redis.RedisError as exc:
            raise _translate(exc) from exc

    async def __aiter__(self) -> AsyncIterator[str]:
        while True:
            lease_id = await self.get(timeout=1.0)
            if lease_id is not None:
                yield lease_id

    async def aclose(self) -> None:
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def __aenter__(self) -> AsyncPreemptionListener:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
