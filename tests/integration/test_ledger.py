"""The ledger against a real Redis: every operation, its refusals, and agreement with policy.py.

Time is driven by a fake clock (``now_ms``) so TTLs and reaping are exact. Every test that
takes ``ledger_client`` (or ``ledger``) runs twice: on one Redis server and on a Redis Cluster
(``ledger_redis_url``).
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import UTC, datetime
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.retry import Retry

from backfill.errors import LedgerError, LedgerUnavailable
from backfill.keys import FENCE_EPOCH_SHIFT
from backfill.ledger import (
    ActiveLease,
    AsyncLedger,
    Denial,
    HeartbeatResult,
    Lease,
    LeaseRef,
    LeaseStatus,
    Ledger,
    NodePool,
    PartialBatchError,
    ReserveRequest,
    script_source,
)
from backfill.policy import (
    AdmissionRequest,
    ClassLimits,
    DecisionKind,
    PoolPolicy,
    Reason,
    ServiceClass,
    batch_slack,
    choose_victims,
    decide,
    interactive_room,
)
from backfill.reservations import BatchOvercommit
from tests.support_policy import pool_policy

T0 = 1_700_000_000_000
TTL = 10_000
POLICY = pool_policy(8192, 8192, 2000, 256, 64)
BATCH = ServiceClass.BATCH
INTERACTIVE = ServiceClass.INTERACTIVE
REDIS_URL = "redis://127.0.0.1:6379/0"


def at(ms: int) -> datetime:
    return datetime.fromtimestamp(ms / 1000, UTC)


@pytest.fixture
def ledger(ledger_client: redis.Redis, redis_namespace: str) -> Ledger:
    return Ledger(ledger_client, redis_namespace, POLICY, lease_ttl_ms=TTL)


def open_pool(ledger: Ledger, node: str = "n1", capacity: int = 10_000, block: int = 16) -> None:
    ledger.rebuild([NodePool(node, capacity, block)], [], epoch=1, now_ms=T0)


LeaseSpec = tuple[int, int, bool, int, int | None]


def drawn_leases(node: str, specs: list[LeaseSpec], step_ms: int) -> list[ActiveLease]:
    """Live leases from drawn (tokens, generated, preemptible, age, deadline) tuples; age and
    deadline count steps of ``step_ms`` before and after T0."""
    return [
        ActiveLease(
            f"ls_{i:02x}",
            node,
            t,
            i + 1,
            at(T0 + TTL),
            preemptible=p,
            generated_tokens=g,
            started_at=at(T0 - s * step_ms),
            deadline=None if d is None else at(T0 + d * step_ms),
        )
        for i, (t, g, p, s, d) in enumerate(specs)
    ]


def admitted(result: Lease | Denial) -> Lease:
    assert isinstance(result, Lease), result
    return result


def denied(result: Lease | Denial) -> Denial:
    assert isinstance(result, Denial), result
    return result


def dump(client: redis.Redis, namespace: str) -> dict[bytes, Any]:
    """Every key of the namespace with its full content."""
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(match=f"{namespace}:*"):
        kind = client.type(key)
        if kind == b"hash":
            out[key] = client.hgetall(key)
        elif kind == b"zset":
            out[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == b"set":
            out[key] = client.smembers(key)
        else:
            out[key] = client.get(key)
    return out


# -- pools and readiness


def test_a_fresh_ledger_is_not_ready_and_admits_no_batch(ledger: Ledger) -> None:
    assert not ledger.is_ready()
    assert ledger.register_pool("n1", 10_000, 16) == 0  # no epoch before a rebuild
    d = denied(ledger.reserve("n1", BATCH, 10, 10, now_ms=T0))
    assert d.reason is Reason.LEDGER_REBUILDING
    assert not d.permanent
    open_pool(ledger)
    assert ledger.is_ready()
    admitted(ledger.reserve("n1", BATCH, 10, 10, now_ms=T0))


def test_snapshot_reports_pool_use_and_live_leases(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0, owner="w1"))
    b = admitted(ledger.reserve("n1", INTERACTIVE, 10, 20, now_ms=T0))
    ledger.observe("n1", 3000, now_ms=T0)
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert (snap.capacity_tokens, snap.reserve_tokens, snap.block_size) == (10_000, 2000, 16)
    assert (snap.batch_in_use, snap.interactive_in_use, snap.observed_non_batch) == (208, 32, 3000)
    assert snap.slack == batch_slack(snap.state, POLICY) == 10_000 - 3256 - 208 - 64
    assert snap.interactive_room == interactive_room(snap.state, POLICY)
    assert {x.lease_id for x in snap.leases} == {a.lease_id, b.lease_id}
    assert ledger.snapshot("nowhere", now_ms=T0) is None
    assert ledger.nodes() == ["n1"]


def test_reserve_on_an_unknown_node_is_an_error_once_ready(ledger: Ledger) -> None:
    open_pool(ledger)
    with pytest.raises(LedgerError, match="unknown node"):
        ledger.reserve("nope", BATCH, 1, 1, now_ms=T0)


def test_a_node_registered_after_the_rebuild_takes_the_current_epoch(ledger: Ledger) -> None:
    open_pool(ledger)
    assert ledger.register_pool("n2", 5000, 16) == 1
    lease = admitted(ledger.reserve("n2", BATCH, 1, 1, now_ms=T0))
    assert lease.fencing_token == FENCE_EPOCH_SHIFT + 1


def lose_node_keys(client: redis.Redis, ledger: Ledger, node: str) -> None:
    """What a Redis Cluster shard that lost its data does to a node it held: every key of the
    node's slot is gone, the ledger's own keys (in another slot) are not."""
    node_keys = ledger.keys.node(node).keys()
    for key in node_keys:
        client.delete(key)


def test_a_node_whose_keys_were_lost_stays_closed_until_the_rebuild(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    open_pool(ledger)
    ledger.register_pool("n2", 10_000, 16)
    kept = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    lost = admitted(ledger.reserve("n2", BATCH, 100, 100, now_ms=T0))
    lose_node_keys(ledger_client, ledger, "n2")
    assert not ledger.is_ready()
    d = denied(ledger.reserve("n2", BATCH, 1, 1, now_ms=T0))  # not "unknown node"
    assert d.reason is Reason.LEDGER_REBUILDING
    # Its worker registers it again: a node the ledger held is not new, it waits.
    assert ledger.register_pool("n2", 10_000, 16) == 0
    assert denied(ledger.reserve("n2", BATCH, 1, 1, now_ms=T0)).reason is Reason.LEDGER_REBUILDING
    admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))  # the other node is untouched
    record = ActiveLease(lost.lease_id, "n2", lost.tokens, lost.fencing_token, at(T0 + TTL))
    report = ledger.rebuild(
        [NodePool("n1", 10_000, 16), NodePool("n2", 10_000, 16)], [record], epoch=2, now_ms=T0
    )
    assert (report.restored, report.skipped) == (1, 0)
    assert ledger.is_ready()
    snap = ledger.snapshot("n2", now_ms=T0)
    assert snap is not None
    assert snap.ready
    assert [x.lease_id for x in snap.leases] == [lost.lease_id]
    assert ledger.release(kept, now_ms=T0) is LeaseStatus.RELEASED
    assert admitted(ledger.reserve("n2", BATCH, 1, 1, now_ms=T0)).fencing_token > (
        lost.fencing_token
    )


def test_a_refused_registration_of_a_new_node_leaves_the_ledger_ready(ledger: Ledger) -> None:
    open_pool(ledger)
    with pytest.raises(LedgerError, match="reserve_tokens exceeds"):
        ledger.register_pool("n2", 100, 16, reserve_tokens=101)
    assert ledger.is_ready()  # n2 did not join: no rebuild waits on a pool that never was
    assert ledger.register_pool("n2", 100, 16) == 1


def test_a_rebuild_forgets_a_lost_node_postgres_does_not_know(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    open_pool(ledger)
    ledger.register_pool("gone", 10_000, 16)
    lose_node_keys(ledger_client, ledger, "gone")
    assert not ledger.is_ready()
    ledger.rebuild([NodePool("n1", 10_000, 16)], [], epoch=2, now_ms=T0)
    assert ledger.is_ready()
    with pytest.raises(LedgerError, match="unknown node"):
        ledger.reserve("gone", BATCH, 1, 1, now_ms=T0)


def test_the_node_list_and_snapshots_reach_every_node(ledger: Ledger) -> None:
    names = [f"gpu-{i}" for i in range(12)]
    ledger.rebuild([NodePool(n, 10_000, 16) for n in names], [], epoch=1, now_ms=T0)
    assert ledger.nodes() == sorted(names)
    for n in names:
        admitted(ledger.reserve(n, BATCH, 10, 10, now_ms=T0))
        snap = ledger.snapshot(n, now_ms=T0)
        assert snap is not None
        assert (snap.ready, snap.batch_in_use) == (True, 32)


# -- reserve


def test_reserve_admits_batch_within_slack_with_a_fencing_token(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 29, now_ms=T0, deadline_ms=T0 + 5))
    b = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    assert a.tokens == 144
    assert (a.expires_at_ms, a.started_at_ms, a.deadline_ms) == (T0 + TTL, T0, T0 + 5)
    assert b.fencing_token == a.fencing_token + 1
    assert a.fencing_token // FENCE_EPOCH_SHIFT == 1


def test_an_embedding_reserves_its_prompt_alone_in_whole_blocks(ledger: Ledger) -> None:
    # No output at all (/v1/embeddings): 16 prompt tokens are one block, not two.
    open_pool(ledger)
    assert admitted(ledger.reserve("n1", BATCH, 16, 0, now_ms=T0)).tokens == 16
    assert admitted(ledger.reserve("n1", BATCH, 17, 0, n=3, now_ms=T0)).tokens == 3 * 32
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.batch_in_use == 16 + 96


def test_reserve_is_idempotent_per_lease_id(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, lease_id="ls_a", now_ms=T0))
    again = admitted(ledger.reserve("n1", BATCH, 100, 100, lease_id="ls_a", now_ms=T0 + 1))
    assert again.fencing_token == a.fencing_token
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.batch_in_use == a.tokens
    ledger.release(a, now_ms=T0)
    with pytest.raises(LedgerError, match="already ended"):
        ledger.reserve("n1", BATCH, 100, 100, lease_id="ls_a", now_ms=T0)


def test_reserve_denies_with_the_policy_reason(ledger: Ledger) -> None:
    open_pool(ledger)
    over = denied(ledger.reserve("n1", BATCH, 8000, 193, now_ms=T0))
    assert (over.reason, over.permanent) == (Reason.OVER_CLASS_LIMIT, True)
    huge = denied(ledger.reserve("n1", BATCH, 4000, 4000, now_ms=T0))
    assert (huge.reason, huge.permanent, huge.tokens) == (Reason.LARGER_THAN_POOL, True, 8000)
    admitted(ledger.reserve("n1", BATCH, 3000, 3000, now_ms=T0))
    full = denied(ledger.reserve("n1", BATCH, 1000, 1000, now_ms=T0))
    assert (full.reason, full.permanent, full.slack) == (
        Reason.NO_SLACK,
        False,
        10_000 - 2000 - 6000 - 64,
    )
    assert full.retry_after_s == POLICY.defer_retry_after_s


def test_observed_non_batch_use_narrows_batch_slack(ledger: Ledger) -> None:
    open_pool(ledger)
    assert ledger.observe("n1", 7000, now_ms=T0) == 10_000 - 7256 - 64
    assert denied(ledger.reserve("n1", BATCH, 1500, 1500, now_ms=T0)).reason is Reason.NO_SLACK
    assert ledger.observe("nowhere", 1) is None


def test_overcommit_charges_preemptible_batch_the_measured_share(
    ledger_client: redis.Redis, redis_namespace: str
) -> None:
    policy = PoolPolicy(
        interactive_reserve_tokens=2000, batch_overcommit=BatchOvercommit.from_ratio(0.25)
    )
    ledger = Ledger(ledger_client, redis_namespace, policy, lease_ttl_ms=TTL)
    open_pool(ledger)
    assert admitted(ledger.reserve("n1", BATCH, 96, 1000, now_ms=T0)).tokens == 352
    capped = admitted(ledger.reserve("n1", BATCH, 96, 1000, preemptible=False, now_ms=T0))
    assert capped.tokens == 1104
    assert admitted(ledger.reserve("n1", INTERACTIVE, 96, 1000, now_ms=T0)).tokens == 1104


# -- settle, heartbeat, release


def test_settle_records_use_and_never_grows_the_reservation(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    r = ledger.settle("n1", a.lease_id, a.fencing_token, 50, reservation_tokens=10_000, now_ms=T0)
    assert (r.status, r.tokens, r.generated_tokens) == (LeaseStatus.OK, 208, 50)
    r = ledger.settle("n1", a.lease_id, a.fencing_token, 30, reservation_tokens=150, now_ms=T0)
    assert (r.tokens, r.generated_tokens) == (160, 50)  # rounded to blocks; generated kept
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.batch_in_use == 160


def test_settle_many_settles_each_lease_in_order_and_refuses_a_stale_holder(
    ledger: Ledger,
) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    b = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    results = ledger.settle_many(
        "n1",
        [
            (a.lease_id, a.fencing_token, 40),
            (b.lease_id, b.fencing_token + 99, 70),
            (b.lease_id, b.fencing_token, 64),
        ],
        now_ms=T0,
    )
    assert [(r.status, r.generated_tokens) for r in results] == [
        (LeaseStatus.OK, 40),
        (LeaseStatus.FENCED, None),
        (LeaseStatus.OK, 64),
    ]
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert {lease.lease_id: lease.generated_tokens for lease in snap.leases} == {
        a.lease_id: 40,
        b.lease_id: 64,
    }
    assert ledger.settle_many("n1", [], now_ms=T0) == []


def test_heartbeat_extends_a_live_lease(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    hb = ledger.heartbeat("n1", a.lease_id, a.fencing_token, now_ms=T0 + 9000)
    assert hb.ok
    assert hb.expires_at_ms == T0 + 9000 + TTL
    assert ledger.reap("n1", now_ms=T0 + TTL + 1) == []
    hb = ledger.heartbeat("n1", a.lease_id, a.fencing_token, ttl_ms=5, now_ms=T0 + 9000)
    assert hb.expires_at_ms == T0 + 9005


def test_a_node_heartbeats_its_leases_in_one_call_each_answered_in_order(
    ledger: Ledger,
) -> None:
    open_pool(ledger)
    live = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    gone = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    ledger.release(gone, now_ms=T0)
    beats = ledger.heartbeat_many(
        "n1",
        [
            (live.lease_id, live.fencing_token),
            (live.lease_id, live.fencing_token + 1),
            (gone.lease_id, gone.fencing_token),
            ("ls_never", 1),
            ("", 1),  # refused by the script: an error in its place, the rest answered
        ],
        ttl_ms=500,
        now_ms=T0 + 9000,
    )
    assert [b.status if isinstance(b, HeartbeatResult) else type(b) for b in beats] == [
        LeaseStatus.OK,
        LeaseStatus.FENCED,
        LeaseStatus.ALREADY_RELEASED,
        LeaseStatus.UNKNOWN,
        LedgerError,
    ]
    first = beats[0]
    assert isinstance(first, HeartbeatResult)
    assert first.expires_at_ms == T0 + 9500
    assert ledger.heartbeat_many("n1", [], now_ms=T0) == []


def test_release_is_idempotent(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    assert ledger.release(a, now_ms=T0) is LeaseStatus.RELEASED
    after = dump(ledger._client, ledger.keys.namespace)
    assert ledger.release(a, now_ms=T0) is LeaseStatus.ALREADY_RELEASED
    assert dump(ledger._client, ledger.keys.namespace) == after
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.reserved == 0
    assert snap.leases == ()


def test_a_stale_holder_changes_nothing(ledger: Ledger, ledger_client: redis.Redis) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    before = dump(ledger_client, ledger.keys.namespace)
    stale = LeaseRef("n1", a.lease_id, a.fencing_token - 1)
    assert ledger.release(stale, now_ms=T0) is LeaseStatus.FENCED
    assert (
        ledger.settle(
            "n1", a.lease_id, a.fencing_token + 1, 5, reservation_tokens=16, now_ms=T0
        ).status
        is LeaseStatus.FENCED
    )
    assert ledger.heartbeat("n1", a.lease_id, 7, now_ms=T0).status is LeaseStatus.FENCED
    assert dump(ledger_client, ledger.keys.namespace) == before


def test_an_expired_lease_is_lost_to_its_holder(ledger: Ledger, ledger_client: redis.Redis) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    before = dump(ledger_client, ledger.keys.namespace)
    late = T0 + TTL
    assert (
        ledger.heartbeat("n1", a.lease_id, a.fencing_token, now_ms=late).status
        is LeaseStatus.EXPIRED
    )
    assert (
        ledger.settle("n1", a.lease_id, a.fencing_token, 1, now_ms=late).status
        is LeaseStatus.EXPIRED
    )
    assert dump(ledger_client, ledger.keys.namespace) == before
    assert ledger.reap("n1", now_ms=late) == [a.lease_id]
    assert ledger.release(a, now_ms=late) is LeaseStatus.EXPIRED
    assert (
        ledger.heartbeat("n1", a.lease_id, a.fencing_token, now_ms=late).status
        is LeaseStatus.EXPIRED
    )


def test_the_holders_release_of_an_expired_lease_reclaims_it_at_once(ledger: Ledger) -> None:
    """A holder that releases its lease just after the lease expired (its heartbeat came
    late: a busy machine, a worker stopping) gets 'expired', and the lease's tokens go back to
    the slack at once, as the reaper would give them. Before, the release changed nothing and
    the tokens held the slack until the next reap: a node whose workers restart with no reaper
    running (or before its next tick) saw no slack and stalled."""
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    late = T0 + TTL
    other = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=late - 1))
    wrong = LeaseRef(a.node, a.lease_id, a.fencing_token + 1)
    assert ledger.release(wrong, now_ms=late) is LeaseStatus.FENCED
    snap = ledger.snapshot("n1", now_ms=late)
    assert snap is not None
    assert snap.batch_in_use == a.tokens + other.tokens  # a stale holder frees nothing
    assert ledger.release(a, now_ms=late) is LeaseStatus.EXPIRED
    snap = ledger.snapshot("n1", now_ms=late)
    assert snap is not None
    assert snap.batch_in_use == other.tokens
    assert [x.lease_id for x in snap.leases] == [other.lease_id]
    assert ledger.reap("n1", now_ms=late) == []  # nothing left for the reaper
    assert ledger.release(a, now_ms=late) is LeaseStatus.EXPIRED  # still final, still idempotent
    assert (
        ledger.heartbeat("n1", a.lease_id, a.fencing_token, now_ms=late).status
        is LeaseStatus.EXPIRED
    )


def test_reservations_whose_answer_was_lost_are_released_by_id_and_owner(
    ledger: Ledger,
) -> None:
    """A ``reserve_many`` whose reply is lost with its connection may have been granted: its
    holder knows the lease ids and owners it asked with, not the fencing tokens. Before, such
    leases held the node's slack until their TTL ran out; now the holder gives them back at
    once, and a reservation that never arrived is refused should it still come."""
    open_pool(ledger)
    granted = ReserveRequest("n1", BATCH, 100, 100, owner="n1/7/1")
    other = admitted(ledger.reserve("n1", BATCH, 100, 100, owner="n1/8/1", now_ms=T0))
    (lease,) = ledger.reserve_many([granted], now_ms=T0)
    assert isinstance(lease, Lease)
    never_sent = ReserveRequest("n1", BATCH, 100, 100, owner="n1/9/1")
    wrong_owner = ReserveRequest("n1", BATCH, 1, 1, lease_id=other.lease_id, owner="n1/8/0")
    statuses = ledger.release_unconfirmed([granted, never_sent, wrong_owner], now_ms=T0)
    assert statuses == [LeaseStatus.RELEASED, LeaseStatus.UNKNOWN, LeaseStatus.FENCED]
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert [x.lease_id for x in snap.leases] == [other.lease_id]
    assert snap.batch_in_use == other.tokens
    # Idempotent; the one never granted is refused if it arrives late.
    again = ledger.release_unconfirmed([granted, never_sent], now_ms=T0)
    assert again == [LeaseStatus.ALREADY_RELEASED, LeaseStatus.ALREADY_RELEASED]
    with pytest.raises(LedgerError, match="already ended"):
        ledger.reserve_many([never_sent], now_ms=T0)
    # The lease it released is over for its holder too.
    assert ledger.release(lease, now_ms=T0) is LeaseStatus.ALREADY_RELEASED


def test_reap_reclaims_only_leases_past_their_ttl(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    b = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0 + 5000))
    assert ledger.reap("n1", now_ms=T0 + TTL - 1) == []
    assert ledger.reap("n1", now_ms=T0 + TTL) == [a.lease_id]
    snap = ledger.snapshot("n1", now_ms=T0 + TTL)
    assert snap is not None
    assert snap.batch_in_use == b.tokens


def test_reap_many_reclaims_each_nodes_expired_leases_in_order_of_the_nodes_given(
    ledger: Ledger, redis_namespace: str, ledger_redis_url: str
) -> None:
    nodes = [f"n{i}" for i in range(1, 41)]  # on a cluster: keys on every shard
    ledger.rebuild([NodePool(n, 10_000, 16) for n in nodes], [], epoch=1, now_ms=T0)
    first = {n: admitted(ledger.reserve(n, BATCH, 100, 100, now_ms=T0)) for n in nodes[::3]}
    later = {n: admitted(ledger.reserve(n, BATCH, 100, 100, now_ms=T0 + 5000)) for n in nodes[1::3]}
    assert ledger.reap_many(nodes, now_ms=T0 + TTL - 1) == [[]] * len(nodes)
    assert ledger.reap_many(nodes, now_ms=T0 + TTL) == [
        [first[n].lease_id] if n in first else [] for n in nodes
    ]
    assert ledger.reap_many(list(reversed(nodes)), now_ms=T0 + TTL) == [[]] * len(nodes)
    assert ledger.reap_many([]) == []
    for n in nodes:
        snap = ledger.snapshot(n, now_ms=T0 + TTL)
        assert snap is not None
        assert snap.batch_in_use == (later[n].tokens if n in later else 0)

    async def reap_the_rest() -> list[list[str]]:
        aledger = AsyncLedger.from_url(ledger_redis_url, redis_namespace, POLICY, lease_ttl_ms=TTL)
        try:
            return await aledger.reap_many(nodes, now_ms=T0 + 5000 + TTL)
        finally:
            await aledger.aclose()

    assert asyncio.run(reap_the_rest()) == [
        [later[n].lease_id] if n in later else [] for n in nodes
    ]


def test_the_ready_markers_of_a_whole_fleet_are_read_together(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    nodes = [f"n{i}" for i in range(1, 41)]
    ledger.rebuild([NodePool(n, 10_000, 16) for n in nodes], [], epoch=1, now_ms=T0)
    assert ledger.incomplete_nodes() == frozenset()
    assert ledger.is_ready()
    for n in ("n3", "n17", "n40"):
        lose_node_keys(ledger_client, ledger, n)
    assert ledger.incomplete_nodes() == {"n3", "n17", "n40"}
    assert not ledger.is_ready()
    lost = {"n3", "n17", "n40"}
    ledger.rebuild(
        [NodePool(n, 10_000, 16) for n in sorted(lost)], [], epoch=2, now_ms=T0, only=lost
    )
    assert ledger.incomplete_nodes() == frozenset()
    assert ledger.is_ready()


def test_reserve_reclaims_expired_leases_first(ledger: Ledger) -> None:
    open_pool(ledger)
    admitted(ledger.reserve("n1", BATCH, 3000, 3000, now_ms=T0))
    assert denied(ledger.reserve("n1", BATCH, 1000, 1000, now_ms=T0)).reason is Reason.NO_SLACK
    admitted(ledger.reserve("n1", BATCH, 1000, 1000, now_ms=T0 + TTL))


def test_ended_leases_are_forgotten_after_a_while(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    ledger.release(a, now_ms=T0)
    ledger.reap("n1", now_ms=T0 + 10 * 60 * 1000)
    assert ledger.release(a, now_ms=T0).value == "already_released"
    ledger.reap("n1", now_ms=T0 + 16 * 60 * 1000)
    assert ledger.release(a, now_ms=T0 + 16 * 60 * 1000) is LeaseStatus.UNKNOWN


# -- malformed arguments


def reserve_request(lease_id: str, service: str = "batch", seq: str = "1") -> list[str]:
    """One request's arguments to the reserve script: a well-formed one unless told otherwise."""
    return [lease_id, service, "1", "1", "1", "100", "", "1", "", seq, ""]


NODE_SCRIPTS_BAD_ARGS: list[tuple[str, list[str]]] = [
    ("reserve", ["ch", "", "1", "ls_x", "vip", "1", "1", "1", "100", "", "1", "", "1", ""]),
    ("reserve", ["ch", "", "1", "ls_x", "batch", "-1", "1", "1", "100", "", "1", "", "1", ""]),
    # a reservation of nothing (no prompt, no output)
    ("reserve", ["ch", "", "1", "ls_x", "batch", "0", "0", "1", "100", "", "1", "", "1", ""]),
    ("reserve", ["ch", "", "1", "ls_x", "batch", "1", "-1", "1", "100", "", "1", "", "1", ""]),
    ("reserve", ["ch", "", "1", "ls_x", "batch", "1", "1", "1.5", "100", "", "1", "", "1", ""]),
    ("reserve", ["ch", "", "1", "ls_x", "batch", "1", "1", "1", "inf", "", "1", "", "1", ""]),
    ("reserve", ["ch", "", "1", "ls_x", "batch", "1", "1", "1", "100", "", "yes", "", "1", ""]),
    ("reserve", ["ch", "", "1", "", "batch", "1", "1", "1", "100", "", "1", "", "1", ""]),
    ("reserve", ["ch", "x", "1", "ls_x", "batch", "1", "1", "1", "100", "", "1", "", "1", ""]),
    (
        "reserve",
        ["ch", "", "1", "ls_x", "batch", "1", "1", "1", "100", "", "1", "", ""],
    ),  # 10 of 11
    # a tenant share of nothing, of more than the whole node, or on a batch request
    ("reserve", ["ch", "", "1", *reserve_request("ls_x", "interactive")[:-1], "0"]),
    ("reserve", ["ch", "", "1", *reserve_request("ls_x", "interactive")[:-1], "1000001"]),
    ("reserve", ["ch", "", "1", *reserve_request("ls_x")[:-1], "500000"]),
    ("reserve", ["ch", "", "0"]),
    # the second request of a batch is malformed: the first is not admitted either
    ("reserve", ["ch", "", "2", *reserve_request("ls_x"), *reserve_request("ls_y", seq="2")]),
    ("reserve", ["ch", "", "2", *reserve_request("ls_x"), *reserve_request("ls_x")]),
    # ls_a is a live batch lease; ls_b ended
    ("reserve", ["ch", "", "2", *reserve_request("ls_x"), *reserve_request("ls_a", "interactive")]),
    ("reserve", ["ch", "", "2", *reserve_request("ls_x"), *reserve_request("ls_b")]),
    ("settle", ["", "ls_a", "nan", "5", ""]),
    ("settle", ["", "ls_a", "1", "-5", ""]),
    ("settle", ["", "ls_a", "1", "5", "abc"]),
    ("heartbeat", ["", "ls_a", "1", "0"]),
    ("heartbeat", ["", "ls_a", "1"]),
    ("release", ["", "1", "ls_a", "1e400"]),
    ("release", ["", "1", "", "1"]),
    ("release", ["", "2", "ls_a", "1", "ls_b"]),
    ("release", ["", "0"]),
    ("preempt", ["ch", "", "-3"]),
    ("preempt", ["ch", "", "10", ""]),
    ("reap", ["", "0"]),
    ("observe", ["", "-1"]),
    ("snapshot", ["x"]),
    ("register_pool", ["0", "16", "0", "0", "0", "1", "1", "0", "", ""]),
    ("register_pool", ["100", "16", "101", "0", "0", "1", "1", "0", "", ""]),
    ("register_pool", ["100", "16", "0", "0", "0", "1", "1", "2000000", "", ""]),
    ("register_pool", ["100", "16", "0", "0", "0", "1", "1", "0", "0", ""]),
    ("register_pool", ["100", "16", "0", "0", "0", "1", "1", "0", "99999999", ""]),
    ("register_pool", ["100", "16", "0", "0", "0", "1", "1", "0", "1", ""]),  # stale epoch
    ("register_pool", ["100", "16", "0", "0", "0", "1", "1", "0", "", "0"]),
    ("register_pool", ["100", "16", "0", "0", "0", "1", "1", "0", "", "99999999"]),
    ("register_pool", ["100", "16", "0", "0", "0", "1", "1", "0", ""]),  # 9 of 10
    ("restore", ["", "1", "ls_r", "10", "5", str(T0 + 1), "", "1", "0", "0", ""]),  # 9 of 10
    ("restore", ["", "1", "ls_r", "10", "-5", str(T0 + 1), "", "1", "0", "0", "", "batch"]),
    ("restore", ["", "1", "ls_r", "10", "5", str(T0 + 1), "", "1", "0", "0", "", "both"]),
    # a fencing token of the current epoch cannot be restored
    (
        "restore",
        [
            *("", "1", "ls_r", "10", str(3 * FENCE_EPOCH_SHIFT), str(T0 + 1), "", "1", "0"),
            *("0", "", "interactive"),
        ],
    ),
]


@pytest.mark.parametrize(("script", "args"), NODE_SCRIPTS_BAD_ARGS)
def test_malformed_arguments_change_no_key(
    ledger: Ledger, ledger_client: redis.Redis, script: str, args: list[str]
) -> None:
    ledger.rebuild([NodePool("n1", 10_000, 16)], [], epoch=3, now_ms=T0)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, lease_id="ls_a", now_ms=T0))
    admitted(ledger.reserve("n1", INTERACTIVE, 100, 100, now_ms=T0))
    ledger.release(
        admitted(ledger.reserve("n1", BATCH, 1, 1, lease_id="ls_b", now_ms=T0)), now_ms=T0
    )
    assert a.fencing_token > 0
    before = dump(ledger_client, ledger.keys.namespace)
    raw = ledger_client.register_script(script_source(script))
    with pytest.raises(redis.ResponseError, match="backfill: "):
        raw(keys=ledger.keys.node("n1").keys(), args=args)
    assert dump(ledger_client, ledger.keys.namespace) == before


def test_script_refusals_become_ledger_errors(ledger: Ledger) -> None:
    ledger.rebuild([NodePool("n1", 10_000, 16)], [], epoch=4, now_ms=T0)
    with pytest.raises(LedgerError, match="stale epoch"):
        ledger.register_pool("n1", 100, 16, epoch=1)


def test_an_unreachable_redis_is_reported_as_unavailable() -> None:
    client = redis.Redis(port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    ledger = Ledger(client, "bfdown")
    with pytest.raises(LedgerUnavailable):
        ledger.reserve("n1", BATCH, 1, 1)
    with pytest.raises(LedgerUnavailable):
        ledger.reserve_many([ReserveRequest("n1", BATCH, 1, 1)])
    with pytest.raises(LedgerUnavailable):
        ledger.is_ready()


# -- preemption


def test_interactive_preempts_batch_frees_its_tokens_and_tells_its_worker(
    ledger: Ledger,
) -> None:
    open_pool(ledger)
    listener = ledger.listen_preemptions("n1")
    try:
        old = admitted(ledger.reserve("n1", BATCH, 1900, 2000, now_ms=T0))
        new = admitted(ledger.reserve("n1", BATCH, 1900, 2000, now_ms=T0 + 1))
        ledger.settle("n1", old.lease_id, old.fencing_token, 500, now_ms=T0 + 2)
        chat = admitted(ledger.reserve("n1", INTERACTIVE, 2000, 2000, now_ms=T0 + 3))
        assert chat.preempted == (new.lease_id,)
        assert listener.get(timeout=2.0) == new.lease_id
        assert listener.get(timeout=0.05) is None
        snap = ledger.snapshot("n1", now_ms=T0 + 3)
        assert snap is not None
        assert (snap.interactive_in_use, snap.batch_in_use) == (4000, old.tokens)
        assert ledger.release(new, now_ms=T0 + 4) is LeaseStatus.PREEMPTED
        assert (
            ledger.heartbeat("n1", new.lease_id, new.fencing_token, now_ms=T0 + 4).status
            is LeaseStatus.PREEMPTED
        )
    finally:
        listener.close()


def test_interactive_without_preemption_is_denied_no_room(ledger: Ledger) -> None:
    open_pool(ledger)
    admitted(ledger.reserve("n1", BATCH, 3900, 3900, now_ms=T0))
    d = denied(ledger.reserve("n1", INTERACTIVE, 1000, 1500, allow_preemption=False, now_ms=T0))
    assert d.reason is Reason.NO_ROOM


def test_preempt_never_takes_a_non_preemptible_lease(ledger: Ledger) -> None:
    open_pool(ledger)
    capped = admitted(ledger.reserve("n1", BATCH, 3000, 3000, preemptible=False, now_ms=T0))
    result = ledger.preempt("n1", 100, now_ms=T0)
    assert (result.sufficient, result.victims, result.freed_tokens) == (False, (), 0)
    assert ledger.preempt("n1", 100, victims=[capped.lease_id], now_ms=T0).victims == ()
    d = denied(ledger.reserve("n1", INTERACTIVE, 2000, 2100, now_ms=T0))
    assert d.reason is Reason.NO_ROOM


def test_preempt_of_named_victims_skips_those_no_longer_live(ledger: Ledger) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    b = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    ledger.release(a, now_ms=T0)
    result = ledger.preempt(
        "n1", 400, victims=[a.lease_id, b.lease_id, b.lease_id, "ls_zz"], now_ms=T0
    )
    assert (result.victims, result.freed_tokens) == ((b.lease_id,), b.tokens)
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.batch_in_use == 0


# -- rebuild


def test_rebuild_restores_live_batch_leases_and_reopens_batch(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    open_pool(ledger)
    a = admitted(ledger.reserve("n1", BATCH, 1000, 1000, now_ms=T0, deadline_ms=T0 + 99))
    b = admitted(ledger.reserve("n1", BATCH, 500, 500, now_ms=T0))
    ledger.settle("n1", a.lease_id, a.fencing_token, 40, now_ms=T0)
    records = [
        ActiveLease(
            x.lease_id,
            "n1",
            x.tokens,
            x.fencing_token,
            at(x.expires_at_ms),
            generated_tokens=40 if x is a else 0,
            started_at=at(T0),
            deadline=at(T0 + 99) if x is a else None,
        )
        for x in (a, b)
    ]
    for key in ledger_client.scan_iter(match=f"{ledger.keys.namespace}:*"):
        ledger_client.delete(key)  # Redis lost its data
    assert not ledger.is_ready()
    assert denied(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0)).reason is Reason.LEDGER_REBUILDING
    # The worker re-registers its pool before the rebuild: still closed, no epoch.
    assert ledger.register_pool("n1", 10_000, 16) == 0
    assert (
        denied(ledger.reserve("n1", INTERACTIVE, 1, 1, now_ms=T0)).reason
        is Reason.LEDGER_REBUILDING
    )
    report = ledger.rebuild([NodePool("n1", 10_000, 16)], records, epoch=2, now_ms=T0 + 1)
    assert (report.epoch, report.restored, report.skipped) == (2, 2, 0)
    assert ledger.is_ready()
    snap = ledger.snapshot("n1", now_ms=T0 + 1)
    assert snap is not None
    assert snap.batch_in_use == a.tokens + b.tokens
    restored = {x.lease_id: x for x in snap.leases}
    assert restored[a.lease_id].generated_tokens == 40
    assert restored[a.lease_id].deadline_ms == T0 + 99
    assert restored[a.lease_id].fencing_token == a.fencing_token
    c = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0 + 1))
    assert c.fencing_token > max(a.fencing_token, b.fencing_token)
    assert ledger.release(a, now_ms=T0 + 2) is LeaseStatus.RELEASED


def test_between_its_phases_a_rebuild_keeps_batch_closed_and_interactive_in_the_reserve(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    # Phase one of a rebuild: the pool is back with its new epoch, the leases are not yet.
    ledger.register_pool("n1", 10_000, 16, epoch=5)
    assert not ledger.is_ready()
    assert denied(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0)).reason is Reason.LEDGER_REBUILDING
    admitted(ledger.reserve("n1", INTERACTIVE, 999, 1000, now_ms=T0))  # 2000 = the reserve
    d = denied(ledger.reserve("n1", INTERACTIVE, 1, 1, now_ms=T0))
    assert d.reason is Reason.LEDGER_REBUILDING
    assert ledger.preempt("n1", 1, now_ms=T0).victims == ()


def test_rebuild_counts_no_lease_twice_and_resurrects_no_ended_one(ledger: Ledger) -> None:
    open_pool(ledger)
    live = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    gone = admitted(ledger.reserve("n1", BATCH, 100, 100, now_ms=T0))
    ledger.release(gone, now_ms=T0)
    # Postgres was read before `gone` was released, and also lists a lease already expired.
    records = [
        ActiveLease(x.lease_id, "n1", x.tokens, x.fencing_token, at(T0 + TTL)) for x in (live, gone)
    ]
    records.append(ActiveLease("ls_old", "n1", 5000, 9, at(T0 - 1)))
    report = ledger.rebuild([NodePool("n1", 10_000, 16)], records, epoch=1, now_ms=T0)
    assert (report.restored, report.skipped) == (0, 3)
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.batch_in_use == live.tokens


def test_rebuild_picks_an_epoch_above_every_fencing_token_seen(ledger: Ledger) -> None:
    record = ActiveLease("ls_a", "n1", 16, 7 * FENCE_EPOCH_SHIFT + 3, at(T0 + TTL))
    report = ledger.rebuild([NodePool("n1", 10_000, 16)], [record], epoch=2, now_ms=T0)
    assert report.epoch == 8
    lease = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    assert lease.fencing_token == 8 * FENCE_EPOCH_SHIFT + 1
    with pytest.raises(LedgerError, match="no pool record"):
        ledger.rebuild([], [record], epoch=9)


def test_a_spent_fencing_counter_moves_to_the_next_epoch(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    open_pool(ledger)
    first = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    ledger_client.set(ledger.keys.node("n1").fence, FENCE_EPOCH_SHIFT - 1)
    nxt = admitted(ledger.reserve("n1", BATCH, 1, 1, now_ms=T0))
    assert nxt.fencing_token == 2 * FENCE_EPOCH_SHIFT + 1 > first.fencing_token
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.epoch == 2


# -- pipelined and async


def test_pipelined_reserve_and_release_match_single_calls(ledger: Ledger) -> None:
    open_pool(ledger)
    requests = [ReserveRequest("n1", BATCH, 100, 100) for _ in range(40)]
    results = ledger.reserve_many(requests, now_ms=T0)
    leases = [r for r in results if isinstance(r, Lease)]
    denials = [r for r in results if isinstance(r, Denial)]
    assert len(leases) == (10_000 - 2000 - 64) // 208
    assert all(d.reason is Reason.NO_SLACK for d in denials)
    assert ledger.release_many(leases, now_ms=T0) == [LeaseStatus.RELEASED] * len(leases)
    assert ledger.release_many(leases, now_ms=T0) == [LeaseStatus.ALREADY_RELEASED] * len(leases)
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.reserved == 0


def test_a_batch_across_nodes_comes_back_in_request_order(ledger: Ledger) -> None:
    open_pool(ledger)
    ledger.register_pool("n2", 10_000, 16)
    requests = [ReserveRequest(node, BATCH, 1, 1) for node in ("n1", "n2", "n1", "n2")]
    results = ledger.reserve_many(requests, now_ms=T0)
    assert [admitted(r).node for r in results] == ["n1", "n2", "n1", "n2"]
    assert [admitted(r).lease_id for r in results] == [r.lease_id for r in requests]
    assert (
        ledger.release_many([admitted(r) for r in reversed(results)], now_ms=T0)
        == [LeaseStatus.RELEASED] * 4
    )


def test_a_failed_part_of_a_batch_reports_what_the_rest_admitted(ledger: Ledger) -> None:
    open_pool(ledger)
    requests = [ReserveRequest("n1", BATCH, 1, 1), ReserveRequest("nowhere", BATCH, 1, 1)]
    with pytest.raises(PartialBatchError) as caught:
        ledger.reserve_many(requests, now_ms=T0)
    first, second = caught.value.results
    assert isinstance(first, Lease)
    assert isinstance(second, LedgerError)
    assert ledger.release(first, now_ms=T0) is LeaseStatus.RELEASED


def test_the_async_ledger_runs_the_same_scripts(
    ledger: Ledger, redis_namespace: str, ledger_redis_url: str
) -> None:
    open_pool(ledger)

    async def scenario() -> None:
        aledger = AsyncLedger.from_url(ledger_redis_url, redis_namespace, POLICY, lease_ttl_ms=TTL)
        listener = await aledger.listen_preemptions("n1")
        try:
            assert await aledger.is_ready()
            a = admitted(await aledger.reserve("n1", BATCH, 3000, 3000, now_ms=T0))
            hb = await aledger.heartbeat("n1", a.lease_id, a.fencing_token, now_ms=T0 + 1)
            assert hb.ok
            chat = admitted(await aledger.reserve("n1", INTERACTIVE, 3000, 3000, now_ms=T0))
            assert chat.preempted == (a.lease_id,)
            assert await listener.get(timeout=2.0) == a.lease_id
            many = await aledger.reserve_many([ReserveRequest("n1", BATCH, 1, 1)], now_ms=T0)
            assert (
                await aledger.release_many([admitted(many[0]), chat], now_ms=T0)
                == [LeaseStatus.RELEASED] * 2
            )
            snap = await aledger.snapshot("n1", now_ms=T0)
            assert snap is not None
            assert snap.reserved == 0
        finally:
            await listener.aclose()
            await aledger.aclose()

    asyncio.run(scenario())


# -- Lua agrees with policy.py

_examples = itertools.count()


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.data(),
    block=st.sampled_from([1, 16, 32]),
    blocks=st.integers(1, 2000),
    overcommit=st.one_of(st.none(), st.integers(1, 1_000_000)),
)
def test_lua_and_policy_agree_on_random_states(
    ledger_client: redis.Redis,
    redis_namespace: str,
    data: st.DataObject,
    block: int,
    blocks: int,
    overcommit: int | None,
) -> None:
    capacity = blocks * block

    def share(*fractions: float) -> int:
        # Sizes as shares of the pool reach every branch; plain integers cluster near zero.
        return int(capacity * data.draw(st.sampled_from(fractions)))

    policy = PoolPolicy(
        interactive=ClassLimits(max(64, share(0.1, 0.5, 2))),
        batch=ClassLimits(max(64, share(0.1, 0.5, 2))),
        interactive_reserve_tokens=share(0, 0.1, 0.3, 0.6),
        headroom_tokens=share(0, 0.05, 0.3),
        safety_margin_tokens=share(0, 0.01, 0.1),
        batch_overcommit=None if overcommit is None else BatchOvercommit(overcommit),
    )
    ledger = Ledger(ledger_client, redis_namespace, policy, lease_ttl_ms=TTL)
    node = f"n{next(_examples)}"
    lease_specs = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from([0, 1, capacity // 20, capacity // 8, capacity // 3]),
                st.integers(0, 50),
                st.booleans(),
                st.integers(0, 5),
                st.one_of(st.none(), st.integers(1, 5)),
            ),
            max_size=8,
        )
    )
    records = drawn_leases(node, lease_specs, step_ms=1000)
    ledger.rebuild([NodePool(node, capacity, block)], records, epoch=1, now_ms=T0)
    room = max(0, capacity - sum(r.tokens for r in records))
    interactive_blocks = data.draw(st.integers(0, room // block))
    if interactive_blocks:
        admitted(
            ledger.reserve(
                node,
                INTERACTIVE,
                block - 1,
                1,
                n=interactive_blocks,
                allow_preemption=False,
                now_ms=T0,
            )
        )
    ledger.observe(node, data.draw(st.integers(0, capacity)), now_ms=T0)

    snap = ledger.snapshot(node, now_ms=T0)
    assert snap is not None
    assert snap.slack == batch_slack(snap.state, policy)
    assert snap.interactive_room == interactive_room(snap.state, policy)

    sizes = (0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.45)
    request = AdmissionRequest(
        data.draw(st.sampled_from(list(ServiceClass))),
        share(*sizes),
        max(1, share(*sizes)),
        n=data.draw(st.integers(1, 3)),
        preemptible=data.draw(st.booleans()),
        allow_preemption=data.draw(st.booleans()),
    )
    expected = decide(request, snap.state, policy, snap.leases)
    event(f"{request.service_class} {expected.kind} {expected.code}")
    result = ledger.reserve(
        node,
        request.service_class,
        request.prompt_tokens,
        request.max_output_tokens,
        n=request.n,
        preemptible=request.preemptible,
        allow_preemption=request.allow_preemption,
        now_ms=T0,
    )
    if expected.admitted:
        lease = admitted(result)
        assert lease.tokens == expected.tokens
        assert lease.preempted == expected.victims
        if expected.kind is DecisionKind.ADMIT:
            assert lease.preempted == ()
    else:
        denial = denied(result)
        assert denial.reason is expected.code
        assert denial.tokens == expected.tokens
        assert denial.permanent == (expected.kind is DecisionKind.REJECT)


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    specs=st.lists(
        st.tuples(
            st.integers(1, 500),
            st.integers(0, 20),
            st.booleans(),
            st.integers(0, 3),
            st.one_of(st.none(), st.integers(1, 3)),
        ),
        max_size=10,
    ),
    needed=st.integers(0, 3000),
)
def test_lua_chooses_the_victims_policy_chooses(
    ledger_client: redis.Redis,
    redis_namespace: str,
    specs: list[LeaseSpec],
    needed: int,
) -> None:
    ledger = Ledger(ledger_client, redis_namespace, POLICY, lease_ttl_ms=TTL)
    node = f"v{next(_examples)}"
    records = drawn_leases(node, specs, step_ms=1)
    ledger.rebuild([NodePool(node, 100_000, 1)], records, epoch=1, now_ms=T0)
    snap = ledger.snapshot(node, now_ms=T0)
    assert snap is not None
    expected = choose_victims(snap.leases, needed)
    result = ledger.preempt(node, needed, now_ms=T0)
    if expected is None:
        assert not result.sufficient
        assert result.victims == ()
    else:
        assert result.sufficient
        assert result.victims == tuple(v.lease_id for v in expected)
