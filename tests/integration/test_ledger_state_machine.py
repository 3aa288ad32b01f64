"""Hypothesis drives the ledger through random sequences of operations against a real Redis,
beside a plain-Python model of what it should hold; after every step the two must agree.

Checked after every step: reserved tokens equal the sum of live leases; 0 <= reserved <=
capacity; batch is never admitted beyond its slack; interactive within its reserve is never
denied because of batch; fencing tokens only grow, across Redis data loss too; what the ledger
counts each owner's interactive leases to hold (a tenant's share is checked against it) is the
sum of that owner's live interactive leases. At the end every live lease is released and the
pool must be back at zero, every owner's count with it (no tokens leak).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from backfill.capacity import round_up_to_block
from backfill.ledger import ActiveLease, Denial, Lease, LeaseRef, LeaseStatus, Ledger, NodePool
from backfill.policy import (
    AdmissionRequest,
    DecisionKind,
    PoolState,
    Reason,
    ServiceClass,
    choose_victims,
    decide,
)
from backfill.redis_client import connect
from tests.support_policy import pool_policy

REDIS_URL = "redis://127.0.0.1:6379/0"
NODE = "gpu0"
CAPACITY = 4096
BLOCK = 16
TTL = 10_000
T0 = 1_700_000_000_000
POLICY = pool_policy(2048, 2048, 1024, 256, 256)
RESERVE = POLICY.reserve_tokens(CAPACITY)
OWNERS = ("", "gateway/t1", "gateway/t2")

READY, FLUSHED, PHASE_ONE = "ready", "flushed", "phase one"


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


@dataclass(frozen=True)
class Held:
    """What the model knows of a lease: the ledger's view, updated as the model applies ops."""

    lease: Lease
    tokens: int
    expires_at_ms: int
    generated: int = 0

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id

    @property
    def service_class(self) -> ServiceClass:
        return self.lease.service_class

    @property
    def preemptible(self) -> bool:
        return self.lease.preemptible

    @property
    def generated_tokens(self) -> int:
        return self.generated

    @property
    def started_at_ms(self) -> int:
        return self.lease.started_at_ms

    @property
    def deadline_ms(self) -> int | None:
        return self.lease.deadline_ms


class LedgerMachine(RuleBasedStateMachine):
    namespaces: itertools.count[int] = itertools.count()
    prefix = "bft"
    url = REDIS_URL

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.client = connect(self.url)
        self.namespace = f"{self.prefix}:m{next(self.namespaces)}"
        self.ledger = Ledger(self.client, self.namespace, POLICY, lease_ttl_ms=TTL)
        self.now = T0
        self.epoch = 1
        self.phase = READY
        self.observed = 0
        self.live: dict[str, Held] = {}
        self.ended: dict[str, tuple[str, int]] = {}  # id -> (reason, fencing token)
        self.records: dict[str, Held] = {}  # batch leases Postgres holds while Redis is empty
        self.highest_fence = 0
        self.ledger.rebuild([NodePool(NODE, CAPACITY, BLOCK)], [], epoch=1, now_ms=self.now)

    # -- the model

    def used(self, cls: ServiceClass) -> int:
        return sum(h.tokens for h in self.live.values() if h.service_class is cls)

    def owners(self) -> dict[str, int]:
        """Each owner's interactive tokens, as the ledger should count them (none at 0)."""
        held: dict[str, int] = {}
        for h in self.live.values():
            if h.service_class is ServiceClass.INTERACTIVE:
                held[h.lease.owner] = held.get(h.lease.owner, 0) + h.tokens
        return {owner: tokens for owner, tokens in held.items() if tokens}

    def state(self) -> PoolState:
        return PoolState(
            CAPACITY,
            BLOCK,
            self.used(ServiceClass.INTERACTIVE),
            self.used(ServiceClass.BATCH),
            self.observed,
            self.phase == READY,
        )

    def end(self, lease_id: str, reason: str) -> None:
        held = self.live.pop(lease_id)
        self.ended[lease_id] = (reason, held.lease.fencing_token)

    def reap_model(self) -> list[str]:
        gone = sorted(i for i, h in self.live.items() if h.expires_at_ms <= self.now)
        for lease_id in gone:
            self.end(lease_id, "expired")
        return gone

    def expected_status(self, lease: Lease, fence: int) -> LeaseStatus:
        held = self.live.get(lease.lease_id)
        if held is not None:
            if held.lease.fencing_token != fence:
                return LeaseStatus.FENCED
            if held.expires_at_ms <= self.now:
                return LeaseStatus.EXPIRED
            return LeaseStatus.OK
        if lease.lease_id in self.ended:
            reason, ended_fence = self.ended[lease.lease_id]
            if ended_fence != fence:
                return LeaseStatus.FENCED
            return LeaseStatus.ALREADY_RELEASED if reason == "released" else LeaseStatus(reason)
        return LeaseStatus.UNKNOWN

    # -- rules

    @rule(
        target=leases,
        cls=st.sampled_from(list(ServiceClass)),
        prompt=st.integers(0, 700),
        out=st.integers(1, 700),
        n=st.integers(1, 2),
        preemptible=st.booleans(),
        allow_preemption=st.booleans(),
        deadline=st.sampled_from([None, 1, 2, 3]),
        owner=st.sampled_from(OWNERS),
        share=st.sampled_from([None, 250_000, 500_000]),
    )
    def reserve(
        self,
        cls: ServiceClass,
        prompt: int,
        out: int,
        n: int,
        preemptible: bool,
        allow_preemption: bool,
        deadline: int | None,
        owner: str,
        share: int | None,
    ) -> Lease | None:
        if cls is ServiceClass.BATCH:
            share = None
        request = AdmissionRequest(
            cls, prompt, out, n, preemptible, allow_preemption, tenant_share_ppm=share
        )
        if self.phase != FLUSHED:
            self.reap_model()  # reserve reclaims expired leases first
        before = self.state()
        expected = decide(
            request,
            before,
            POLICY,
            list(self.live.values()),
            tenant_in_use=self.owners().get(owner, 0),
        )
        deadline_ms = None if deadline is None else T0 + deadline * 1000
        result = self.ledger.reserve(
            NODE,
            cls,
            prompt,
            out,
            n=n,
            preemptible=preemptible,
            allow_preemption=allow_preemption,
            deadline_ms=deadline_ms,
            owner=owner,
            tenant_share_ppm=share,
            now_ms=self.now,
        )
        if self.phase == FLUSHED:
            assert isinstance(result, Denial)
            assert result.reason is Reason.LEDGER_REBUILDING
            return None
        within_reserve = (
            cls is ServiceClass.INTERACTIVE
            and expected.tokens > 0
            and before.interactive_in_use + expected.tokens <= RESERVE
            and expected.code not in (Reason.OVER_CLASS_LIMIT, Reason.TENANT_SHARE)
        )
        if within_reserve:
            assert isinstance(result, Lease), f"interactive within the reserve denied: {result}"
        if not expected.admitted:
            assert isinstance(result, Denial), result
            assert result.reason is expected.code
            return None
        assert isinstance(result, Lease), (expected, result)
        assert result.tokens == expected.tokens
        assert result.preempted == expected.victims
        assert result.fencing_token > self.highest_fence
        self.highest_fence = result.fencing_token
        for victim in result.preempted:
            self.end(victim, "preempted")
        if cls is ServiceClass.BATCH:
            guarded = max(RESERVE, before.interactive_effective + POLICY.headroom_tokens)
            assert before.batch_in_use + result.tokens <= (
                CAPACITY - guarded - POLICY.safety_margin_tokens
            ), "batch beyond its slack"
        self.live[result.lease_id] = Held(result, result.tokens, result.expires_at_ms)
        return result

    @rule(
        lease=leases,
        generated=st.integers(0, 900),
        shrink=st.one_of(st.none(), st.integers(0, 1500)),
    )
    def settle(self, lease: Lease | None, generated: int, shrink: int | None) -> None:
        if lease is None:
            return
        expected = self.expected_status(lease, lease.fencing_token)
        result = self.ledger.settle(
            NODE,
            lease.lease_id,
            lease.fencing_token,
            generated,
            reservation_tokens=shrink,
            now_ms=self.now,
        )
        assert result.status is expected, (result, expected)
        if expected is LeaseStatus.OK:
            held = self.live[lease.lease_id]
            rounded = None if shrink is None else round_up_to_block(shrink, BLOCK)
            tokens = held.tokens if rounded is None else min(held.tokens, rounded)
            self.live[lease.lease_id] = replace(
                held, tokens=tokens, generated=max(held.generated, generated)
            )
            assert (result.tokens, result.generated_tokens) == (
                tokens,
                max(held.generated, generated),
            )

    @rule(lease=leases)
    def heartbeat(self, lease: Lease | None) -> None:
        if lease is None:
            return
        expected = self.expected_status(lease, lease.fencing_token)
        result = self.ledger.heartbeat(NODE, lease.lease_id, lease.fencing_token, now_ms=self.now)
        assert result.status is expected
        if expected is LeaseStatus.OK:
            held = self.live[lease.lease_id]
            self.live[lease.lease_id] = replace(held, expires_at_ms=self.now + TTL)

    @rule(lease=leases)
    def release(self, lease: Lease | None) -> None:
        """Also covers double release: the bundle keeps released leases."""
        if lease is None:
            return
        expected = self.expected_status(lease, lease.fencing_token)
        result = self.ledger.release(lease, now_ms=self.now)
        if expected is LeaseStatus.OK:
            assert result is LeaseStatus.RELEASED
            self.end(lease.lease_id, "released")
        else:
            assert result is expected
            if expected is LeaseStatus.UNKNOWN:
                self.ended[lease.lease_id] = ("released", lease.fencing_token)
            elif expected is LeaseStatus.EXPIRED and lease.lease_id in self.live:
                # Its holder's release reclaims an expired lease not yet reaped.
                self.end(lease.lease_id, "expired")

    @rule(lease=leases, delta=st.sampled_from([-1, 1, 2**32]))
    def stale_release(self, lease: Lease | None, delta: int) -> None:
        if lease is None:
            return
        stale = LeaseRef(NODE, lease.lease_id, lease.fencing_token + delta)
        expected = self.expected_status(lease, stale.fencing_token)
        result = self.ledger.release(stale, now_ms=self.now)
        assert result is expected
        assert result is not LeaseStatus.RELEASED
        if expected is LeaseStatus.UNKNOWN:
            self.ended[lease.lease_id] = ("released", stale.fencing_token)

    @rule(ms=st.sampled_from([1, 1000, TTL // 2, TTL, 2 * TTL]))
    def advance_clock(self, ms: int) -> None:
        self.now += ms

    @precondition(lambda self: self.phase != FLUSHED)
    @rule()
    def reap(self) -> None:
        assert sorted(self.ledger.reap(NODE, now_ms=self.now)) == self.reap_model()

    @precondition(lambda self: self.phase == READY)
    @rule(needed=st.integers(0, CAPACITY))
    def preempt(self, needed: int) -> None:
        expected = choose_victims(list(self.live.values()), needed)
        result = self.ledger.preempt(NODE, needed, now_ms=self.now)
        if expected is None:
            assert not result.sufficient
            assert result.victims == ()
            return
        assert result.victims == tuple(v.lease_id for v in expected)
        for victim in result.victims:
            self.end(victim, "preempted")

    @precondition(lambda self: self.phase != FLUSHED)
    @rule(observed=st.integers(0, CAPACITY))
    def observe(self, observed: int) -> None:
        self.ledger.observe(NODE, observed, now_ms=self.now)
        self.observed = observed

    @precondition(lambda self: self.phase == READY)
    @rule()
    def redis_loses_its_data(self) -> None:
        for key in self.client.scan_iter(match=f"{self.namespace}:*"):
            self.client.delete(key)
        # Postgres still holds the batch leases; interactive leases lived only in Redis.
        self.records = {i: h for i, h in self.live.items() if h.service_class is ServiceClass.BATCH}
        self.live = {}
        self.ended = {}
        self.observed = 0
        self.phase = FLUSHED
        assert not self.ledger.is_ready()

    @precondition(lambda self: self.phase == FLUSHED)
    @rule()
    def rebuild_phase_one(self) -> None:
        """The pool is back with a new epoch; its leases are not yet."""
        self.epoch += 1
        self.ledger.register_pool(NODE, CAPACITY, BLOCK, epoch=self.epoch)
        self.phase = PHASE_ONE

    @precondition(lambda self: self.phase != READY)
    @rule()
    def rebuild(self) -> None:
        records = [
            ActiveLease(
                h.lease_id,
                NODE,
                h.tokens,
                h.lease.fencing_token,
                at(h.expires_at_ms),
                preemptible=h.preemptible,
                generated_tokens=h.generated,
                started_at=at(h.started_at_ms),
                deadline=None if h.deadline_ms is None else at(h.deadline_ms),
            )
            for h in self.records.values()
        ]
        report = self.ledger.rebuild(
            [NodePool(NODE, CAPACITY, BLOCK)], records, epoch=self.epoch + 1, now_ms=self.now
        )
        assert report.epoch > self.epoch
        self.epoch = report.epoch
        restored = 0
        for lease_id, held in self.records.items():
            released = self.ended.get(lease_id) == ("released", held.lease.fencing_token)
            if held.expires_at_ms > self.now and not released:
                self.live[lease_id] = held
                restored += 1
        assert report.restored == restored
        self.records = {}
        self.phase = READY

    # -- invariants

    @invariant()
    def ledger_matches_the_model(self) -> None:
        snap = self.ledger.snapshot(NODE, now_ms=self.now)
        if self.phase == FLUSHED:
            assert snap is None
            return
        assert snap is not None
        assert snap.ready == (self.phase == READY)
        by_class = {
            cls: sum(x.tokens for x in snap.leases if x.service_class is cls)
            for cls in ServiceClass
        }
        assert snap.interactive_in_use == by_class[ServiceClass.INTERACTIVE]
        assert snap.batch_in_use == by_class[ServiceClass.BATCH]
        assert 0 <= snap.reserved <= CAPACITY
        assert {
            x.lease_id: (x.tokens, x.expires_at_ms, x.generated_tokens) for x in snap.leases
        } == {i: (h.tokens, h.expires_at_ms, h.generated) for i, h in self.live.items()}
        assert self.counted_owners() == self.owners()
        # The reap's recount never had to put an owner right: the scripts keep them exact.
        assert self.ledger.counters(NODE).owners_recounted == 0

    def counted_owners(self) -> dict[str, int]:
        raw = self.client.hgetall(self.ledger.keys.node(NODE).owners)
        return {k.decode(): int(v) for k, v in raw.items()}

    def teardown(self) -> None:
        try:
            if self.phase != READY:
                self.rebuild()
            for held in list(self.live.values()):
                self.ledger.release(held.lease, now_ms=self.now)
            self.ledger.reap(NODE, now_ms=self.now + 10 * TTL)
            snap = self.ledger.snapshot(NODE, now_ms=self.now)
            assert snap is not None
            assert snap.reserved == 0, "tokens leaked"
            assert snap.leases == ()
            assert self.counted_owners() == {}, "an owner's tokens leaked"
        finally:
            for key in self.client.scan_iter(match=f"{self.namespace}:*"):
                self.client.delete(key)
            self.client.close()


@pytest.mark.slow
def test_ledger_state_machine(redis_namespace: str, ledger_redis_url: str) -> None:
    LedgerMachine.prefix = redis_namespace
    LedgerMachine.url = ledger_redis_url
    run_state_machine_as_test(
        LedgerMachine,
        settings=settings(max_examples=80, stateful_step_count=40, deadline=None),
    )


def test_decide_kinds_are_all_reachable_in_the_machine_pool() -> None:
    """Guards the machine's sizes: each decision kind must be reachable on its pool."""
    empty = PoolState(CAPACITY, BLOCK)
    busy = PoolState(CAPACITY, BLOCK, interactive_in_use=1000, batch_in_use=2800)
    victim = Held(Lease("ls_v", NODE, ServiceClass.BATCH, 2800, 1, 0, 0), 2800, 0)
    kinds = {
        decide(AdmissionRequest(ServiceClass.BATCH, 100, 100), empty, POLICY).kind,
        decide(AdmissionRequest(ServiceClass.BATCH, 700, 700), busy, POLICY).kind,
        decide(AdmissionRequest(ServiceClass.BATCH, 2000, 700), empty, POLICY).kind,
        decide(AdmissionRequest(ServiceClass.INTERACTIVE, 300, 100), busy, POLICY, [victim]).kind,
    }
    assert kinds == set(DecisionKind)


def test_a_tenant_share_refusal_is_reachable_in_the_machine_pool() -> None:
    """Guards the machine's sizes: a tenant's share can refuse, and let through, its requests."""
    empty = PoolState(CAPACITY, BLOCK)
    quarter = AdmissionRequest(ServiceClass.INTERACTIVE, 700, 700, 1, tenant_share_ppm=250_000)
    assert decide(quarter, empty, POLICY, tenant_in_use=16).code is Reason.TENANT_SHARE
    assert decide(quarter, empty, POLICY).admitted  # holding nothing: not refused by it
    small = AdmissionRequest(ServiceClass.INTERACTIVE, 100, 100, 1, tenant_share_ppm=500_000)
    assert decide(small, empty, POLICY, tenant_in_use=1024).admitted
