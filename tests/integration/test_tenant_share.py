"""A tenant's share of a node's interactive reservations, in the ledger against a real Redis
(one server and a Redis Cluster: ``ledger_client``) and in the gateway's admission loop.

One tenant's interactive requests (all owned ``gateway/{tenant_id}``) may hold at most their
share of a node (``tenant_share_ppm`` of its capacity) while another tenant's are admitted
beside them; the share is counted per owner in the scripts that change the pool's interactive
use (reserve, settle, release, reap, release_unconfirmed, restore), so whatever ends or shrinks
a lease gives its owner exactly that room back.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from backfill.gateway.placement import Admission, AdmissionTiming, admit
from backfill.gateway.refusals import NoInteractiveRoom, TenantShareExceeded
from backfill.gateway.sizing import Sizing
from backfill.ledger import (
    AsyncLedger,
    Denial,
    Lease,
    LeaseStatus,
    Ledger,
    NodePool,
    ReserveRequest,
)
from backfill.policy import (
    AdmissionRequest,
    ClassLimits,
    PoolPolicy,
    Reason,
    ServiceClass,
    decide,
    tenant_share_ppm,
    tenant_share_tokens,
)

T0 = 1_700_000_000_000
TTL = 10_000
CAPACITY = 4096
BLOCK = 16
POLICY = PoolPolicy(
    interactive=ClassLimits(4096), batch=ClassLimits(4096), interactive_reserve_tokens=1024
)
HALF = 500_000  # a tenant may hold half the node: 2048 tokens
A, B = "gateway/tenant-a", "gateway/tenant-b"
INTERACTIVE, BATCH = ServiceClass.INTERACTIVE, ServiceClass.BATCH


@pytest.fixture
def ledger(ledger_client: redis.Redis, redis_namespace: str) -> Ledger:
    ledger = Ledger(ledger_client, redis_namespace, POLICY, lease_ttl_ms=TTL)
    ledger.rebuild([NodePool("n1", CAPACITY, BLOCK)], [], epoch=1, now_ms=T0)
    return ledger


def reserve(ledger: Ledger, owner: str, tokens: int, *, now_ms: int = T0) -> Lease | Denial:
    """An interactive reservation of ``tokens`` (a whole number of blocks) held to HALF."""
    return ledger.reserve(
        "n1", INTERACTIVE, 0, tokens, owner=owner, tenant_share_ppm=HALF, now_ms=now_ms
    )


def admitted(result: Lease | Denial) -> Lease:
    assert isinstance(result, Lease), result
    return result


def refused(result: Lease | Denial) -> Denial:
    assert isinstance(result, Denial), result
    return result


def owners(ledger: Ledger, client: redis.Redis) -> dict[str, int]:
    """What the ledger counts each owner's interactive leases on n1 to hold."""
    raw = client.hgetall(ledger.keys.node("n1").owners)
    return {k.decode(): int(v) for k, v in raw.items()}


def test_a_tenant_at_its_share_is_refused_while_another_is_admitted_on_the_same_node(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    a1 = admitted(reserve(ledger, A, 1024))
    admitted(reserve(ledger, A, 1024))
    denial = refused(reserve(ledger, A, 16))
    assert denial.reason is Reason.TENANT_SHARE
    assert (denial.tenant_in_use, denial.tenant_bound) == (2048, 2048)
    assert denial.retry_after_s is not None  # waiting for its own leases helps
    # The node has room: B (and B alone) gets it.
    assert refused(reserve(ledger, A, 16)).reason is Reason.TENANT_SHARE
    b1 = admitted(reserve(ledger, B, 1024))
    assert owners(ledger, ledger_client) == {A: 2048, B: 1024}
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    assert snap.interactive_in_use == 3072
    assert ledger.counters("n1").denials[("interactive", "tenant_share")] == 2
    # A's room comes back with its own lease, not with B's.
    ledger.release(b1, now_ms=T0)
    assert refused(reserve(ledger, A, 16)).reason is Reason.TENANT_SHARE
    ledger.release(a1, now_ms=T0)
    admitted(reserve(ledger, A, 1024))


def test_a_tenant_over_its_share_preempts_no_batch(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    batch = admitted(ledger.reserve("n1", BATCH, 0, 2048, now_ms=T0))
    admitted(reserve(ledger, A, 2048))
    # The pool is full; A may not hold more, so no batch is preempted for it.
    assert refused(reserve(ledger, A, 1024)).reason is Reason.TENANT_SHARE
    assert ledger.heartbeat("n1", batch.lease_id, batch.fencing_token, now_ms=T0).ok
    # B under its share preempts the batch lease to get in, as interactive always could.
    assert admitted(reserve(ledger, B, 1024)).preempted == (batch.lease_id,)


def test_a_tenant_holding_nothing_is_admitted_even_beyond_its_share(ledger: Ledger) -> None:
    # No request is refused for good by the share: alone on the node it may take more.
    big = admitted(reserve(ledger, A, 3072))
    assert refused(reserve(ledger, A, 16)).reason is Reason.TENANT_SHARE
    ledger.release(big, now_ms=T0)
    admitted(reserve(ledger, A, 16))


def test_without_a_share_one_tenant_may_fill_the_node(ledger: Ledger) -> None:
    for _ in range(4):
        admitted(ledger.reserve("n1", INTERACTIVE, 0, 1024, owner=A, now_ms=T0))
    assert refused(reserve(ledger, B, 16)).reason is Reason.NO_ROOM


def test_released_settled_reaped_and_unconfirmed_leases_give_the_room_back_exactly(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    released = admitted(reserve(ledger, A, 512))
    settled = admitted(reserve(ledger, A, 512))
    expiring = admitted(
        ledger.reserve(
            "n1", INTERACTIVE, 0, 512, owner=A, tenant_share_ppm=HALF, ttl_ms=100, now_ms=T0
        )
    )
    lost_answer = ReserveRequest("n1", INTERACTIVE, 0, 512, owner=A, tenant_share_ppm=HALF)
    [unconfirmed] = ledger.reserve_many([lost_answer], now_ms=T0)
    admitted(unconfirmed)
    assert owners(ledger, ledger_client) == {A: 2048}
    assert refused(reserve(ledger, A, 16)).reason is Reason.TENANT_SHARE

    assert ledger.release(released, now_ms=T0) is LeaseStatus.RELEASED
    assert owners(ledger, ledger_client) == {A: 1536}
    assert ledger.release(released, now_ms=T0) is LeaseStatus.ALREADY_RELEASED  # no twice
    assert owners(ledger, ledger_client) == {A: 1536}

    shrunk = ledger.settle(
        "n1", settled.lease_id, settled.fencing_token, 10, reservation_tokens=100, now_ms=T0
    )
    assert shrunk.tokens == 112
    assert owners(ledger, ledger_client) == {A: 1136}

    assert ledger.reap("n1", now_ms=T0 + 100) == [expiring.lease_id]
    assert owners(ledger, ledger_client) == {A: 624}

    assert ledger.release_unconfirmed([lost_answer], now_ms=T0 + 100) == [LeaseStatus.RELEASED]
    assert owners(ledger, ledger_client) == {A: 112}

    # Exactly the room given back: 2048 - 112 more, and not one block beyond.
    admitted(reserve(ledger, A, 1936, now_ms=T0 + 100))
    assert refused(reserve(ledger, A, 16, now_ms=T0 + 100)).reason is Reason.TENANT_SHARE
    ledger.release(settled, now_ms=T0 + 100)
    snap = ledger.snapshot("n1", now_ms=T0 + 100)
    assert snap is not None
    assert owners(ledger, ledger_client) == {A: 1936} == {A: snap.interactive_in_use}


def test_leases_expired_under_a_reserve_give_the_room_back(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    ledger.reserve(
        "n1", INTERACTIVE, 0, 2048, owner=A, tenant_share_ppm=HALF, ttl_ms=100, now_ms=T0
    )
    assert refused(reserve(ledger, A, 16, now_ms=T0 + 99)).reason is Reason.TENANT_SHARE
    # The reserve reclaims the expired lease first, then finds A holding nothing.
    admitted(reserve(ledger, A, 2048, now_ms=T0 + 100))
    assert owners(ledger, ledger_client) == {A: 2048}


def test_an_owner_holding_nothing_leaves_the_ledger(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    leases = [admitted(reserve(ledger, owner, 512)) for owner in (A, B, A)]
    ledger.release_many(leases, now_ms=T0)
    assert owners(ledger, ledger_client) == {}
    assert not ledger_client.exists(ledger.keys.node("n1").owners)


def test_a_restored_interactive_lease_counts_for_its_owner_again(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    lease = admitted(reserve(ledger, A, 2048))
    node_keys = ledger.keys.node("n1").keys()
    ledger_client.delete(*node_keys)  # the node's shard lost its data
    ledger.rebuild([NodePool("n1", CAPACITY, BLOCK)], [], epoch=5, now_ms=T0)
    assert owners(ledger, ledger_client) == {}
    # The gateway that holds the lease puts it back (LeaseKeeper._restore).
    assert ledger.restore_lease(lease, ttl_ms=TTL, now_ms=T0)
    assert owners(ledger, ledger_client) == {A: 2048}
    assert refused(reserve(ledger, A, 16)).reason is Reason.TENANT_SHARE


def test_the_policy_decides_the_share_as_the_ledger_does(ledger: Ledger) -> None:
    held = admitted(reserve(ledger, A, 1536))
    snap = ledger.snapshot("n1", now_ms=T0)
    assert snap is not None
    for tokens in (512, 528):
        request = AdmissionRequest(INTERACTIVE, 0, tokens, tenant_share_ppm=HALF)
        expected = decide(request, snap.state, POLICY, snap.leases, tenant_in_use=held.tokens)
        result = reserve(ledger, A, tokens)
        assert expected.admitted == isinstance(result, Lease), (expected, result)
        if isinstance(result, Denial):
            assert result.reason is expected.code is Reason.TENANT_SHARE
        else:
            ledger.release(result, now_ms=T0)
    assert tenant_share_tokens(CAPACITY, HALF) == 2048
    assert tenant_share_ppm(0.5) == HALF
    assert tenant_share_ppm(1.0) is None


# -- the gateway's admission loop

FAST = AdmissionTiming(first_backoff_s=0.01, max_backoff_s=0.05)


def sizing(tokens: int) -> Sizing:
    return Sizing(0, tokens, 1, output_defaulted=False)


def test_the_gateway_refuses_a_tenant_at_its_share_naming_it_and_admits_another(
    redis_namespace: str,
) -> None:
    sync = Ledger(redis.Redis.from_url("redis://127.0.0.1:6379/0"), redis_namespace, POLICY)
    sync.rebuild([NodePool("n1", CAPACITY, BLOCK)], [], epoch=1)

    async def main() -> None:
        ledger = AsyncLedger.from_url("redis://127.0.0.1:6379/0", redis_namespace, POLICY)

        async def go(owner: str, tokens: int, wait_s: float = 0.0) -> Admission:
            return await admit(
                ledger,
                ["n1"],
                sizing(tokens),
                lease_id=f"gw_{time.monotonic_ns()}",
                owner=owner,
                ttl_ms=10_000,
                max_wait_s=wait_s,
                timing=FAST,
                tenant_share_ppm=HALF,
            )

        try:
            held = [await go(A, 1024), await go(A, 1024)]
            with pytest.raises(TenantShareExceeded) as caught:
                await go(A, 1024, wait_s=0.2)
            refusal = caught.value
            assert isinstance(refusal, NoInteractiveRoom)  # a 429, with a code of its own
            assert (refusal.code, refusal.reason) == ("tenant_interactive_share", "tenant_share")
            assert (refusal.retry_after_s or 0) >= 1
            assert "2048 of the 2048" in refusal.message
            assert (await go(B, 1024)).lease.node == "n1"

            # A waits (X-Backfill-Max-Wait) for its own lease to end, not for B's.
            async def release_later() -> None:
                await asyncio.sleep(0.3)
                await ledger.release(held[0].lease)

            releaser = asyncio.create_task(release_later())
            waited = await go(A, 1024, wait_s=5.0)
            await releaser
            assert waited.waited_s >= 0.25
            assert waited.attempts > 1
        finally:
            await ledger.aclose()

    try:
        asyncio.run(main())
    finally:
        sync.close()


def test_the_periodic_reap_recounts_what_each_owner_holds_from_the_live_leases(
    ledger: Ledger, ledger_client: redis.Redis
) -> None:
    """Whatever wrote the ledger without counting owners (a process still on a version from
    before they were counted, during a rolling upgrade, reaping or releasing a lease), a count
    off the live leases lasts one reap at most: a count left too high would shrink a tenant's
    share on the node for good."""
    admitted(reserve(ledger, A, 1024))
    owners_key = ledger.keys.node("n1").owners
    ledger_client.hincrby(owners_key, A, 1024)  # a lease ended by a script that did not count
    ledger_client.hincrby(owners_key, B, 512)  # one admitted by such a script, long gone
    assert refused(reserve(ledger, A, 16)).reason is Reason.TENANT_SHARE
    assert ledger.reap("n1", now_ms=T0) == []
    assert owners(ledger, ledger_client) == {A: 1024}
    admitted(reserve(ledger, A, 1024))
    assert ledger.counters("n1").owners_recounted == 2
    assert ledger.reap("n1", now_ms=T0) == []
    assert ledger.counters("n1").owners_recounted == 2  # nothing off since
