"""The ledger's script calls: each one's KEYS and ARGV, and how its reply reads as values.

One builder per script; the operations (:mod:`backfill.ledger.operations`) yield what they
build, and either ledger runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any

from backfill import keys as lk
from backfill.ledger.steps import ScriptCall
from backfill.ledger.values import (
    ActiveLease,
    Denial,
    HeartbeatResult,
    HeldLease,
    Lease,
    LeaseStatus,
    PoolSnapshot,
    PreemptResult,
    PrefixHold,
    ReserveRequest,
    SettleResult,
)
from backfill.policy import PoolPolicy, Reason, ServiceClass


def decoded(value: object) -> str:
    """A reply value as text (Redis answers bytes)."""
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


@dataclass(frozen=True)
class NoPoolDenial(Denial):
    """A reserve found neither the node's pool nor its ready marker: the node is unknown, or
    its keys were lost (a shard lost data). Only the member set, in another slot, tells which;
    the operations ask it (:func:`backfill.ledger.operations.reserve`) and answer an error or a
    plain ``ledger_rebuilding`` denial. Should a failed batch hand one out unresolved, it still
    reads as what it is at worst: rebuilding."""


class LedgerCalls:
    """Each script call's KEYS and ARGV, and how to read its reply, for one namespace."""

    def __init__(self, namespace: str, policy: PoolPolicy, lease_ttl_ms: int) -> None:
        self.keys = lk.LedgerKeys(namespace)
        self.policy = policy
        self.lease_ttl_ms = lease_ttl_ms

    def register_pool(
        self,
        node: str,
        capacity_tokens: int,
        block_size: int,
        policy: PoolPolicy | None,
        epoch: int | None,
        reserve_tokens: int | None = None,
        ledger_epoch: int | None = None,
    ) -> ScriptCall[int]:
        p = policy or self.policy
        reserve = p.reserve_tokens(capacity_tokens) if reserve_tokens is None else reserve_tokens
        ppm = p.batch_overcommit.output_ratio_ppm if p.batch_overcommit else 0
        args = [
            capacity_tokens,
            block_size,
            reserve,
            p.headroom_tokens,
            p.safety_margin_tokens,
            p.interactive.max_sequence_tokens,
            p.batch.max_sequence_tokens,
            ppm,
        ]
        return ScriptCall(
            "register_pool",
            self.keys.node(node).keys(),
            [*map(str, args), _arg(epoch), _arg(ledger_epoch)],
            lambda r: int(r[1]),
        )

    def reserve(
        self, node: str, reqs: Sequence[ReserveRequest], now_ms: int | None
    ) -> ScriptCall[list[Lease | Denial]]:
        nk = self.keys.node(node)
        args = [nk.channel, _arg(now_ms), str(len(reqs))]
        for req in reqs:
            ttl = req.ttl_ms if req.ttl_ms is not None else self.lease_ttl_ms
            args += [
                req.lease_id,
                req.service_class.value,
                str(req.prompt_tokens),
                str(req.max_output_tokens),
                str(req.n),
                str(ttl),
                req.owner,
                "1" if req.preemptible else "0",
                _arg(req.deadline_ms),
                "1" if req.allow_preemption else "0",
                _arg(req.tenant_share_ppm),
                req.prefix_id or "",
                str(req.prefix_tokens),
            ]
        retry = self.policy.defer_retry_after_s

        def parse_one(req: ReserveRequest, reply: list[Any]) -> Lease | Denial:
            if decoded(reply[0]) == "no_pool":
                return NoPoolDenial(
                    node, req.service_class, Reason.LEDGER_REBUILDING, 0, 0, 0, retry
                )
            if decoded(reply[0]) == "denied":
                reason = Reason(decoded(reply[1]))
                permanent = reason in (Reason.OVER_CLASS_LIMIT, Reason.LARGER_THAN_POOL)
                share = reason is Reason.TENANT_SHARE
                return Denial(
                    node,
                    req.service_class,
                    reason,
                    int(reply[2]),
                    int(reply[3]),
                    int(reply[4]),
                    None if permanent else retry,
                    int(reply[5]) if share else None,
                    int(reply[6]) if share else None,
                )
            return Lease(
                lease_id=req.lease_id,
                node=node,
                service_class=req.service_class,
                tokens=int(reply[2]),
                fencing_token=int(reply[1]),
                expires_at_ms=int(reply[3]),
                started_at_ms=int(reply[4]),
                owner=req.owner,
                preemptible=req.preemptible,
                generated_tokens=int(reply[5]),
                deadline_ms=req.deadline_ms or None,
                preempted=tuple(decoded(v) for v in reply[6]),
                prefix_id=req.prefix_id,
                prefix_tokens=req.prefix_tokens,
            )

        def parse(replies: list[Any]) -> list[Lease | Denial]:
            return [parse_one(q, r) for q, r in zip(reqs, replies, strict=True)]

        return ScriptCall("reserve", nk.keys(), args, parse)

    def settle(
        self,
        node: str,
        lease_id: str,
        fencing_token: int,
        generated_tokens: int,
        reservation_tokens: int | None,
        now_ms: int | None,
    ) -> ScriptCall[SettleResult]:
        def parse(reply: list[Any]) -> SettleResult:
            status = LeaseStatus(decoded(reply[0]))
            if status is LeaseStatus.OK:
                return SettleResult(status, int(reply[1]), int(reply[2]))
            return SettleResult(status)

        args = [
            _arg(now_ms),
            lease_id,
            str(fencing_token),
            str(generated_tokens),
            _arg(reservation_tokens),
        ]
        return ScriptCall("settle", self.keys.node(node).keys(), args, parse)

    def heartbeat(
        self, node: str, lease_id: str, fencing_token: int, ttl_ms: int | None, now_ms: int | None
    ) -> ScriptCall[HeartbeatResult]:
        def parse(reply: list[Any]) -> HeartbeatResult:
            status = LeaseStatus(decoded(reply[0]))
            return HeartbeatResult(status, int(reply[1]) if status is LeaseStatus.OK else None)

        ttl = self.lease_ttl_ms if ttl_ms is None else ttl_ms
        args = [_arg(now_ms), lease_id, str(fencing_token), str(ttl)]
        return ScriptCall("heartbeat", self.keys.node(node).keys(), args, parse)

    def release(
        self, node: str, held: Sequence[HeldLease], now_ms: int | None
    ) -> ScriptCall[list[LeaseStatus]]:
        args = [_arg(now_ms), str(len(held))]
        for h in held:
            args += [h.lease_id, str(h.fencing_token)]
        return ScriptCall(
            "release",
            self.keys.node(node).keys(),
            args,
            lambda r: [LeaseStatus(decoded(x)) for x in r],
        )

    def release_unconfirmed(
        self, node: str, reqs: Sequence[ReserveRequest], now_ms: int | None
    ) -> ScriptCall[list[LeaseStatus]]:
        args = [_arg(now_ms), str(len(reqs))]
        for req in reqs:
            args += [req.lease_id, req.owner]
        return ScriptCall(
            "release_unconfirmed",
            self.keys.node(node).keys(),
            args,
            lambda r: [LeaseStatus(decoded(x)) for x in r],
        )

    def preempt(
        self, node: str, tokens_needed: int, victims: Sequence[str] | None, now_ms: int | None
    ) -> ScriptCall[PreemptResult]:
        nk = self.keys.node(node)

        def parse(reply: list[Any]) -> PreemptResult:
            return PreemptResult(
                tuple(decoded(v) for v in reply[2]), int(reply[1]), decoded(reply[0]) == "preempted"
            )

        args = [nk.channel, _arg(now_ms), str(tokens_needed), *(victims or ())]
        return ScriptCall("preempt", nk.keys(), args, parse)

    def reap(self, node: str, limit: int, now_ms: int | None) -> ScriptCall[list[str]]:
        return ScriptCall(
            "reap",
            self.keys.node(node).keys(),
            [_arg(now_ms), str(limit)],
            lambda r: [decoded(v) for v in r],
        )

    def observe(
        self,
        node: str,
        observed_tokens: int,
        now_ms: int | None,
        over_reserved_tokens: int | None = None,
    ) -> ScriptCall[int | None]:
        return ScriptCall(
            "observe",
            self.keys.node(node).keys(),
            [_arg(now_ms), str(observed_tokens), _arg(over_reserved_tokens)],
            lambda r: int(r[1]) if decoded(r[0]) == "ok" else None,
        )

    def snapshot(self, node: str, now_ms: int | None) -> ScriptCall[PoolSnapshot | None]:
        def parse(r: list[Any]) -> PoolSnapshot | None:
            if not r:
                return None
            v = [int(x) for x in r[:18]]
            leases = tuple(lease_from_reply(node, x) for x in r[18])
            return PoolSnapshot(
                node,
                v[0],
                bool(v[1]),
                v[2],
                v[3],
                v[4],
                v[5],
                v[6],
                v[7],
                v[8],
                v[9],
                v[10],
                v[11],
                v[12],
                v[13],
                v[14],
                v[15],
                v[16],
                v[17],
                leases,
                tuple(
                    PrefixHold(decoded(x[0]), int(x[1]), int(x[2]))
                    for x in (r[19] if len(r) > 19 else ())
                ),
            )

        return ScriptCall("snapshot", self.keys.node(node).keys(), [_arg(now_ms)], parse)

    def restore(
        self, node: str, leases: Sequence[ActiveLease], now_ms: int | None
    ) -> ScriptCall[tuple[int, int]]:
        args = [_arg(now_ms), str(len(leases))]
        for a in leases:
            args += [
                a.lease_id,
                str(a.tokens),
                str(a.fencing_token),
                str(_ms(a.expires_at)),
                a.owner,
                "1" if a.preemptible else "0",
                str(a.generated_tokens),
                str(_ms(a.started_at)),
                str(_ms(a.deadline)),
                a.service_class.value,
                a.prefix_id or "",
                str(a.prefix_tokens),
            ]
        return ScriptCall(
            "restore", self.keys.node(node).keys(), args, lambda r: (int(r[0]), int(r[1]))
        )


def plain_denial(d: Denial) -> Denial:
    """``d`` as a plain :class:`Denial` (e.g. a resolved :class:`NoPoolDenial`)."""
    return Denial(**{f.name: getattr(d, f.name) for f in fields(Denial)})


def lease_from_reply(node: str, r: Sequence[Any], preempted: tuple[str, ...] = ()) -> Lease:
    deadline = int(r[9])
    return Lease(
        lease_id=decoded(r[0]),
        node=node,
        service_class=ServiceClass(decoded(r[1])),
        tokens=int(r[2]),
        owner=decoded(r[3]),
        fencing_token=int(r[4]),
        expires_at_ms=int(r[5]),
        preemptible=bool(int(r[6])),
        generated_tokens=int(r[7]),
        started_at_ms=int(r[8]),
        deadline_ms=deadline or None,
        preempted=preempted,
        prefix_id=(decoded(r[10]) or None) if len(r) > 11 else None,
        prefix_tokens=int(r[11]) if len(r) > 11 else 0,
    )
