"""Shared prompt prefixes in the ledger (issue 36), driven by Hypothesis against a real Redis
beside a plain-Python model.

Batch leases that start with one of a few prefixes are reserved, released (twice, and by a
stale holder), heartbeated, left to expire and reaped, preempted, and lost with the rest of
Redis and rebuilt from what Postgres would hold. After every step: each prefix the ledger
holds has as many holders as live leases refer to it (never fewer than one: a prefix with none
is gone), its tokens counted once in batch use, every lease's own tokens beside them; a lease
is admitted exactly when its own tokens, and the prefix's where the node does not hold it
yet, fit the slack. At the end every lease is released and nothing is left held.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
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
from backfill.errors import LedgerError
from backfill.ledger import ActiveLease, Denial, Lease, LeaseStatus, Ledger, NodePool
from backfill.ledger.values import ReserveRequest
from backfill.policy import Reason, ServiceClass
from backfill.redis_client import connect
from tests.support_policy import pool_policy

REDIS_URL = "redis://127.0.0.1:6379/0"
NODE = "gpu0"
CAPACITY = 4096
BLOCK = 16
TTL = 10_000
T0 = 1_700_000_000_000
POLICY = pool_policy(2048, 2048, 1024, 256, 256)
BATCH_CEILING = CAPACITY - max(POLICY.reserve_tokens(CAPACITY), 256) - 256
PREFIXES = {"pa": 4 * BLOCK, "pb": 40 * BLOCK, "pc": 1 * BLOCK}


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


@dataclass
class Held:
    lease: Lease
    own: int
    prefix: str | None
    expires_at_ms: int


class PrefixLedgerMachine(RuleBasedStateMachine):
    namespaces: itertools.count[int] = itertools.count()
    prefix = "bft"
    url = REDIS_URL

    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.client = connect(self.url)
        self.namespace = f"{self.prefix}:p{next(self.namespaces)}"
        self.ledger = Ledger(self.client, self.namespace, POLICY, lease_ttl_ms=TTL)
        self.now = T0
        self.epoch = 1
        self.flushed = False
        self.live: dict[str, Held] = {}
        self.ended: set[str] = set()
        self.records: dict[str, Held] = {}
        self.ledger.rebuild([NodePool(NODE, CAPACITY, BLOCK)], [], epoch=1, now_ms=self.now)

    # -- the model

    def holders(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for h in self.live.values():
            if h.prefix is not None:
                counts[h.prefix] = counts.get(h.prefix, 0) + 1
        return counts

    def batch_in_use(self) -> int:
        own = sum(h.own for h in self.live.values())
        return own + sum(PREFIXES[p] for p in self.holders())

    def slack(self) -> int:
        return max(0, BATCH_CEILING - self.batch_in_use())

    def end(self, lease_id: str) -> None:
        self.live.pop(lease_id)
        self.ended.add(lease_id)

    def reap_model(self) -> list[str]:
        gone = sorted(i for i, h in self.live.items() if h.expires_at_ms <= self.now)
        for lease_id in gone:
            self.end(lease_id)
        return gone

    # -- rules

    @precondition(lambda self: not self.flushed)
    @rule(
        target=leases,
        prefix=st.sampled_from([None, *PREFIXES]),
        suffix=st.integers(1, 600),
        out=st.integers(1, 600),
        preemptible=st.booleans(),
    )
    def reserve(self, prefix: str | None, suffix: int, out: int, preemptible: bool) -> Lease | None:
        ptok = PREFIXES[prefix] if prefix else 0
        prompt = ptok + suffix
        self.reap_model()
        whole = round_up_to_block(prompt + out, BLOCK)
        own = whole - ptok
        need = own if prefix in self.holders() else whole
        slack = self.slack()
        request = ReserveRequest(
            NODE,
            ServiceClass.BATCH,
            prompt,
            out,
            preemptible=preemptible,
            prefix_id=prefix,
            prefix_tokens=ptok,
        )
        [result] = self.ledger.reserve_many([request], now_ms=self.now)
        if prompt + out > POLICY.batch.max_sequence_tokens:
            assert isinstance(result, Denial)
            assert result.reason is Reason.OVER_CLASS_LIMIT
            return None
        if need > BATCH_CEILING:
            assert isinstance(result, Denial)
            assert result.reason is Reason.LARGER_THAN_POOL
            return None
        if need > slack:
            assert isinstance(result, Denial), (need, slack, result)
            assert result.reason is Reason.NO_SLACK
            assert result.tokens == need
            return None
        assert isinstance(result, Lease), (need, slack, result)
        assert result.tokens == own
        self.live[result.lease_id] = Held(result, own, prefix, result.expires_at_ms)
        return result

    @rule(lease=leases)
    def release(self, lease: Lease | None) -> None:
        """Double releases too: the bundle keeps released leases."""
        if lease is None or self.flushed:
            return
        status = self.ledger.release(lease, now_ms=self.now)
        held = self.live.get(lease.lease_id)
        if held is not None:
            if held.expires_at_ms <= self.now:
                assert status is LeaseStatus.EXPIRED
            else:
                assert status is LeaseStatus.RELEASED
            self.end(lease.lease_id)
        else:
            assert status is not LeaseStatus.RELEASED

    @rule(lease=leases)
    def stale_release(self, lease: Lease | None) -> None:
        if lease is None or self.flushed:
            return
        status = self.ledger.release(
            Lease(
                lease.lease_id,
                NODE,
                ServiceClass.BATCH,
                lease.tokens,
                lease.fencing_token + 1,
                0,
                0,
            ),
            now_ms=self.now,
        )
        assert status is not LeaseStatus.RELEASED
        if status is LeaseStatus.UNKNOWN:
            self.ended.add(lease.lease_id)

    @rule(lease=leases)
    def heartbeat(self, lease: Lease | None) -> None:
        if lease is None or self.flushed:
            return
        result = self.ledger.heartbeat(NODE, lease.lease_id, lease.fencing_token, now_ms=self.now)
        held = self.live.get(lease.lease_id)
        if result.status is LeaseStatus.OK:
            assert held is not None
            held.expires_at_ms = self.now + TTL

    @rule(ms=st.sampled_from([1, TTL // 2, TTL, 2 * TTL]))
    def advance_clock(self, ms: int) -> None:
        self.now += ms

    @precondition(lambda self: not self.flushed)
    @rule()
    def reap(self) -> None:
        """A worker that died: its leases expire and the reaper takes them."""
        assert sorted(self.ledger.reap(NODE, now_ms=self.now)) == self.reap_model()

    @precondition(lambda self: not self.flushed)
    @rule(needed=st.integers(0, CAPACITY))
    def preempt(self, needed: int) -> None:
        result = self.ledger.preempt(NODE, needed, now_ms=self.now)
        for victim in result.victims:
            assert self.live[victim].lease.preemptible
            self.end(victim)
        if result.sufficient:
            # What a victim's ending frees is its own tokens at least: a prefix's only with
            # its last holder.
            assert result.freed_tokens >= needed or not result.victims

    @precondition(lambda self: not self.flushed)
    @rule()
    def redis_loses_its_data(self) -> None:
        for key in self.client.scan_iter(match=f"{self.namespace}:*"):
            self.client.delete(key)
        self.records = dict(self.live)
        self.live = {}
        self.ended = set()
        self.flushed = True

    @precondition(lambda self: self.flushed)
    @rule()
    def rebuild(self) -> None:
        records = [
            ActiveLease(
                i,
                NODE,
                h.own,
                h.lease.fencing_token,
                at(h.expires_at_ms),
                preemptible=h.lease.preemptible,
                started_at=at(h.lease.started_at_ms),
                prefix_id=h.prefix,
                prefix_tokens=PREFIXES[h.prefix] if h.prefix else 0,
            )
            for i, h in self.records.items()
        ]
        report = self.ledger.rebuild(
            [NodePool(NODE, CAPACITY, BLOCK)], records, epoch=self.epoch + 1, now_ms=self.now
        )
        self.epoch = report.epoch
        self.live = {i: h for i, h in self.records.items() if h.expires_at_ms > self.now}
        assert report.restored == len(self.live)
        self.records = {}
        self.flushed = False

    # -- invariants

    @invariant()
    def prefixes_are_held_once_by_their_live_leases(self) -> None:
        if self.flushed:
            return
        snap = self.ledger.snapshot(NODE, now_ms=self.now)
        assert snap is not None
        held = {p.prefix_id: (p.tokens, p.holders) for p in snap.prefixes}
        assert held == {p: (PREFIXES[p], n) for p, n in self.holders().items()}
        assert all(holders >= 1 for _, holders in held.values())
        assert {x.lease_id: (x.tokens, x.prefix_id) for x in snap.leases} == {
            i: (h.own, h.prefix) for i, h in self.live.items()
        }
        assert snap.batch_in_use == self.batch_in_use()
        assert snap.batch_in_use <= BATCH_CEILING
        assert self.ledger.counters(NODE).owners_recounted == 0
        recounted = self.client.hget(self.ledger.keys.node(NODE).pool, "prefixes_recounted")
        assert recounted is None, "the reap had to put a prefix's holders right"

    def teardown(self) -> None:
        try:
            if self.flushed:
                self.rebuild()
            for h in list(self.live.values()):
                self.ledger.release(h.lease, now_ms=self.now)
            snap = self.ledger.snapshot(NODE, now_ms=self.now)
            assert snap is not None
            assert snap.reserved == 0, "tokens leaked"
            assert snap.prefixes == (), "a prefix outlived its last holder"
        finally:
            for key in self.client.scan_iter(match=f"{self.namespace}:*"):
                self.client.delete(key)
            self.client.close()


@pytest.mark.slow
def test_prefix_ledger_state_machine(redis_namespace: str, ledger_redis_url: str) -> None:
    PrefixLedgerMachine.prefix = redis_namespace
    PrefixLedgerMachine.url = ledger_redis_url
    run_state_machine_as_test(
        PrefixLedgerMachine,
        settings=settings(max_examples=60, stateful_step_count=40, deadline=None),
    )


def test_a_prefix_given_with_other_tokens_than_the_node_holds_is_refused(
    redis_namespace: str,
) -> None:
    ledger = Ledger(connect(REDIS_URL), redis_namespace, POLICY, lease_ttl_ms=TTL)
    ledger.rebuild([NodePool(NODE, CAPACITY, BLOCK)], [], epoch=1, now_ms=T0)
    first = ReserveRequest(
        NODE, ServiceClass.BATCH, 100, 10, prefix_id="p", prefix_tokens=4 * BLOCK
    )
    [lease] = ledger.reserve_many([first], now_ms=T0)
    assert isinstance(lease, Lease)
    assert lease.tokens == round_up_to_block(110, BLOCK) - 4 * BLOCK
    other = ReserveRequest(
        NODE, ServiceClass.BATCH, 100, 10, prefix_id="p", prefix_tokens=2 * BLOCK
    )
    with pytest.raises(LedgerError, match="held with 64 tokens"):
        ledger.reserve_many([other], now_ms=T0)
    with pytest.raises(ValueError, match="shared prefix"):
        ReserveRequest(NODE, ServiceClass.INTERACTIVE, 100, 10, prefix_id="p", prefix_tokens=16)
    with pytest.raises(ValueError, match="shared prefix"):
        ReserveRequest(NODE, ServiceClass.BATCH, 16, 10, prefix_id="p", prefix_tokens=16)
