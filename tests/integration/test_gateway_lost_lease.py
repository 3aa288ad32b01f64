"""An interactive lease the ledger lost while its request runs (Redis restarted, or a replica
took over before the reserve reached it), on one Redis server and on a Redis Cluster.

Interactive leases are not in Postgres, so a rebuild cannot bring them back: the gateway's
lease keeper, whose heartbeat answers ``unknown``, closes the node to batch (as a worker
does for a lost batch lease) and puts its lease back once the rebuild has given the node a
new epoch. Until then the request's KV would be counted by no one and handed to batch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import pytest

from backfill.gateway.leases import LeaseBeats, LeaseKeeper
from backfill.ledger import AsyncLedger, Lease, Ledger, NodePool
from backfill.policy import ClassLimits, PoolPolicy, ServiceClass
from backfill.redis_client import SyncRedis

POLICY = PoolPolicy(
    interactive=ClassLimits(4096), batch=ClassLimits(4096), interactive_reserve_tokens=1024
)
NODE = "n1"
POOL = NodePool(NODE, 8192, 16)
TTL_MS = 5_000


@pytest.fixture
def ledger(ledger_client: SyncRedis, redis_namespace: str) -> Ledger:
    sync = Ledger(ledger_client, redis_namespace, POLICY, lease_ttl_ms=TTL_MS)
    sync.rebuild([POOL], [], epoch=1)
    return sync


def lose(client: SyncRedis, ledger: Ledger, lease: Lease) -> None:
    """What a replica promoted before the reserve reached it holds: no lease, no use."""
    keys = ledger.keys.node(lease.node)
    client.hdel(keys.leases, lease.lease_id)
    client.zrem(keys.expiry, lease.lease_id)
    client.hincrby(keys.pool, "i_used", -lease.tokens)


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_lost_interactive_lease_closes_the_node_and_is_restored_after_the_rebuild(
    ledger: Ledger, ledger_client: SyncRedis, redis_namespace: str, ledger_redis_url: str
) -> None:
    async def scenario() -> None:
        aledger = AsyncLedger.from_url(ledger_redis_url, redis_namespace, POLICY, TTL_MS)
        try:
            lease = await aledger.reserve(NODE, ServiceClass.INTERACTIVE, 300, 200)
            assert isinstance(lease, Lease), lease
            beats = LeaseBeats(aledger, interval_s=0.05, ttl_ms=TTL_MS)
            keeper = LeaseKeeper(lease, beats)
            keeper.generated = 40
            lose(ledger_client, ledger, lease)

            async def in_use() -> int:
                snap = await aledger.snapshot(NODE)
                assert snap is not None
                return snap.interactive_in_use

            assert await in_use() == 0

            async def closed() -> bool:
                return not await aledger.is_ready()

            # Batch is closed on the node until it is rebuilt (the request still runs).
            assert await until(closed), "the node was not closed for a rebuild"
            denied = await aledger.reserve(NODE, ServiceClass.BATCH, 10, 10)
            assert not isinstance(denied, Lease)
            assert denied.reason == "ledger_rebuilding"
            # The maintenance tick's rebuild, from Postgres: no batch lease held there.
            await asyncio.to_thread(ledger.rebuild, [POOL], [], epoch=2)

            async def restored() -> bool:
                return await in_use() == lease.tokens

            assert await until(restored), f"the lease was not put back: {await in_use()}"
            snap = await aledger.snapshot(NODE)
            assert snap is not None
            (held,) = (x for x in snap.leases if x.lease_id == lease.lease_id)
            assert held.service_class is ServiceClass.INTERACTIVE
            assert held.fencing_token == lease.fencing_token
            assert held.generated_tokens >= 40
            # Batch slack leaves the restored lease out; the keeper goes on heartbeating it.
            assert snap.capacity_tokens - snap.batch_in_use - snap.interactive_in_use >= 0
            await asyncio.sleep(0.2)
            beat = await aledger.heartbeat(NODE, lease.lease_id, lease.fencing_token)
            assert beat.ok, beat
            await keeper.end(used_tokens=350)
            assert await in_use() == 0
            assert await aledger.is_ready()
            await beats.aclose()
        finally:
            await aledger.aclose()

    asyncio.run(scenario())


def test_one_round_beats_and_settles_every_lease_of_a_node_and_stops_for_a_lost_one(
    ledger: Ledger, redis_namespace: str, ledger_redis_url: str
) -> None:
    async def scenario() -> None:
        aledger = AsyncLedger.from_url(ledger_redis_url, redis_namespace, POLICY, TTL_MS)
        await aledger.register_pool("n2", 8192, 16)
        beats = LeaseBeats(aledger, interval_s=3600, ttl_ms=TTL_MS)  # rounds run by hand
        try:
            keepers = []
            for node in (NODE, NODE, "n2"):
                lease = await aledger.reserve(node, ServiceClass.INTERACTIVE, 50, 50)
                assert isinstance(lease, Lease), lease
                keepers.append(LeaseKeeper(lease, beats))
            for k, keeper in enumerate(keepers):
                keeper.generated = 10 * (k + 1)
                keeper.admitted_s -= 3600  # due in this round
            # A lease released behind its keeper's back (as the reaper ends an expired one).
            gone = keepers[1]
            await aledger.release(gone.lease)
            # A beat sets the expiry to the server's now + TTL in whole milliseconds: on a fast
            # machine it can land in the millisecond of the reserve and move nothing.
            await asyncio.sleep(0.01)
            await beats.beat()
            assert not gone.beating
            for keeper in (keepers[0], keepers[2]):
                snap = await aledger.snapshot(keeper.lease.node)
                assert snap is not None
                (held,) = (x for x in snap.leases if x.lease_id == keeper.lease.lease_id)
                assert held.generated_tokens == keeper.generated
                assert held.expires_at_ms > keeper.lease.expires_at_ms
            # A new lease is not beaten in the round right after its admission.
            fresh = await aledger.reserve(NODE, ServiceClass.INTERACTIVE, 50, 50)
            assert isinstance(fresh, Lease)
            young = LeaseKeeper(fresh, beats)
            young.generated = 7
            await beats.beat()
            snap = await aledger.snapshot(NODE)
            assert snap is not None
            (held,) = (x for x in snap.leases if x.lease_id == fresh.lease_id)
            assert held.generated_tokens == 0
            for keeper in [*keepers, young]:
                await keeper.end(None)
            assert len(beats) == 0
            snap = await aledger.snapshot(NODE)
            assert snap is not None
            assert snap.interactive_in_use == 0
        finally:
            await beats.aclose()
            await aledger.aclose()

    asyncio.run(scenario())
