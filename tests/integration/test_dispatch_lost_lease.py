"""A lease the ledger lost while its worker runs the item (a write Redis dropped: a replica
promoted before the reserve reached it) closes the node to batch until the ledger is rebuilt
from Postgres, which counts the lease again; the item itself runs on and succeeds.

Real Postgres and Redis; the engine is the stand-in, holding each answer a few seconds.
"""

from __future__ import annotations

import asyncio
import time

from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import ensure_ledger
from backfill.states import ItemState
from tests.integration.standin_engine import (
    StandInEngine,
    quick_dispatcher,
    stand_in_node,
    submit_completions,
)

NODE = "n-lost"
BLOCK = 16


def lose_lease(ledger: Ledger, lease_id: str, tokens: int) -> None:
    """What a failover that dropped the reserve leaves: no lease, its tokens not counted."""
    nk = ledger.keys.node(NODE)
    ledger.client.hdel(nk.leases, lease_id)
    ledger.client.zrem(nk.expiry, lease_id)
    ledger.client.hincrby(nk.pool, "b_used", -tokens)


def test_a_lease_missing_from_the_ledger_closes_the_node_until_the_rebuild_restores_it(
    settings: Settings,
) -> None:
    engine = StandInEngine(blocks=256, block=BLOCK, hold_s=4.0)
    with stand_in_node(settings, NODE, BLOCK, blocks=256) as (repo, ledger, aledger):
        job = submit_completions(repo, "t-lost", 1, 64)
        dispatcher = quick_dispatcher(
            NODE, engine, repo, aledger, BLOCK, heartbeat_interval_s=0.2, work_budget=None
        )

        async def scenario() -> tuple[str, bool]:
            runner = asyncio.create_task(dispatcher.run())
            try:
                snap = None
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    snap = ledger.snapshot(NODE)
                    if snap is not None and snap.leases:
                        break
                assert snap is not None
                assert snap.leases
                lease = snap.leases[0]
                lose_lease(ledger, lease.lease_id, lease.tokens)
                deadline = time.monotonic() + 5
                while ledger.is_ready() and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                closed = not ledger.is_ready()
                # The maintenance tick that follows.
                report = ensure_ledger(repo, ledger, max_preemptions=3)
                assert report is not None
                assert report.restored == 1
                again = ledger.snapshot(NODE)
                assert again is not None
                assert [x.lease_id for x in again.leases] == [lease.lease_id]
                assert again.batch_in_use == lease.tokens
                for _ in range(400):
                    await asyncio.sleep(0.05)
                    if repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == 1:
                        break
                return lease.lease_id, closed
            finally:
                dispatcher.stop()
                await asyncio.wait_for(runner, 30)
                await aledger.aclose()

        _, closed = asyncio.run(scenario())
        assert closed, "the worker did not close the node for a rebuild"
        assert repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == 1
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.reserved == 0
