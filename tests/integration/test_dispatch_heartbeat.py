"""The worker's heartbeat rewrites a claim in Postgres only when it is due (``claims_due``):
at a TTL long against the beat the claim's expiry stands for several beats while the ledger's
lease is beaten every beat; at a TTL short against the beat it is extended as often as needed
to stay well above half of it. Every item still succeeds once.

Real Postgres and Redis; the engine is the stand-in, holding each answer a few seconds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from backfill.config import Settings
from backfill.ledger import AsyncLedger
from backfill.states import ItemState
from backfill.store import Repository
from tests.integration.standin_engine import (
    StandInEngine,
    quick_dispatcher,
    stand_in_node,
    submit_completions,
)
from tests.integration.support_sql import query_rows
from tests.reliability.services import RedisServer
from worker.dispatch import NodeDispatcher

BLOCK = 16
BEAT_S = 0.2


def _claims(repo: Repository, job: str) -> dict[int, datetime]:
    rows = query_rows(
        repo,
        "SELECT id, lease_expires_at FROM items WHERE job_id = :j "
        "AND state IN ('reserved', 'running')",
        j=job,
    )
    return {r[0]: r[1] for r in rows}


def _beating(
    node: str, ttl_s: float, engine: StandInEngine, repo: Repository, aledger: AsyncLedger
) -> NodeDispatcher:
    """A stand-in node's dispatcher beating every ``BEAT_S`` with leases of ``ttl_s``."""
    return quick_dispatcher(
        node,
        engine,
        repo,
        aledger,
        BLOCK,
        heartbeat_interval_s=BEAT_S,
        lease_ttl_s=ttl_s,
        work_budget=None,
    )


@pytest.mark.parametrize(("ttl_s", "node"), [(30.0, "n-beat-long"), (2.0, "n-beat-short")])
def test_a_claim_is_rewritten_only_when_its_heartbeat_is_due(
    settings: Settings, ttl_s: float, node: str
) -> None:
    engine = StandInEngine(blocks=256, block=BLOCK, hold_s=3.0)
    with stand_in_node(settings, node, BLOCK, 256, AsyncLedger) as (repo, ledger, aledger):
        job = submit_completions(repo, f"t-{node}", 2, 16)
        dispatcher = _beating(node, ttl_s, engine, repo, aledger)

        async def scenario() -> tuple[list[dict[int, datetime]], list[float]]:
            runner = asyncio.create_task(dispatcher.run())
            claims: list[dict[int, datetime]] = []
            lease_expiries: list[float] = []
            try:
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if len(_claims(repo, job)) == 2:
                        break
                # 2.4 s of beats (12), while both items are held by the engine.
                began = time.monotonic()
                while time.monotonic() - began < 2.4:
                    claims.append(_claims(repo, job))
                    snap = ledger.snapshot(node)
                    assert snap is not None
                    lease_expiries.append(max(x.expires_at_ms for x in snap.leases))
                    await asyncio.sleep(BEAT_S / 2)
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    if repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == 2:
                        break
                return claims, lease_expiries
            finally:
                dispatcher.stop()
                await asyncio.wait_for(runner, 30)
                await aledger.aclose()

        claims, lease_expiries = asyncio.run(scenario())
        assert repo.stats.counted_states(job) == {ItemState.SUCCEEDED: 2}
    held = [c for c in claims if len(c) == 2]
    assert len(held) >= 10, claims
    # Each item's claim expiries over the window (both started in one statement, at one time).
    expiries = {i: {c[i] for c in held} for i in held[0]}
    # The ledger's lease is beaten every beat either way.
    assert len(set(lease_expiries)) >= 5, lease_expiries
    if ttl_s == 30.0:
        # Due once 14.7 s have passed: not in these 2.4 s, so each claim kept its first expiry.
        assert all(len(e) == 1 for e in expiries.values()), expiries
    else:
        # Due once 0.7 s have passed: each claim rewritten in these 2.4 s (about every 0.8 s).
        assert all(len(e) >= 2 for e in expiries.values()), expiries


STALL_S = 3.0
STALL_TTL_S = 4.0


def test_a_stalled_ledger_does_not_hold_up_the_claims_extension_in_postgres(
    settings: Settings, tmp_path: Path
) -> None:
    """The ledger's Redis stops answering (SIGSTOP: its connections stay open, as a shard
    failing over or a hung server leaves them) for most of a lease TTL while two items are
    held: each claim is still extended in Postgres during the stall (claims and leases beat on
    clocks of their own; before, the claims waited behind the ledger's call), and once Redis
    answers again both items succeed on their first attempt."""
    redis_server = RedisServer(tmp_path)
    redis_server.start()
    own = settings.model_copy(update={"redis_url": redis_server.url})
    node = "n-beat-stall"
    engine = StandInEngine(blocks=256, block=BLOCK, hold_s=2 * STALL_S + 2)
    try:
        with stand_in_node(own, node, BLOCK, 256, AsyncLedger) as (repo, _ledger, aledger):
            job = submit_completions(repo, "t-stall", 2, 16)
            dispatcher = _beating(node, STALL_TTL_S, engine, repo, aledger)

            async def scenario() -> tuple[dict[int, datetime], dict[int, datetime]]:
                runner = asyncio.create_task(dispatcher.run())
                try:
                    for _ in range(100):
                        await asyncio.sleep(0.05)
                        if len(_claims(repo, job)) == 2:
                            break
                    await asyncio.sleep(2 * BEAT_S)  # a lease beat or two before the stall
                    assert redis_server.proc is not None
                    os.kill(redis_server.proc.pid, signal.SIGSTOP)
                    try:
                        await asyncio.sleep(0.3)
                        early = _claims(repo, job)
                        await asyncio.sleep(STALL_S - 0.4)
                        late = _claims(repo, job)
                    finally:
                        os.kill(redis_server.proc.pid, signal.SIGCONT)
                    for _ in range(400):
                        await asyncio.sleep(0.05)
                        if repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == 2:
                            break
                    return early, late
                finally:
                    dispatcher.stop()
                    await asyncio.wait_for(runner, 30)
                    await aledger.aclose()

            early, late = asyncio.run(scenario())
            assert len(early) == 2, early
            # Due 1.7 s after its last extension, beaten every 0.2 s: each claim was extended
            # in the 2.6 s between the two reads, all of it inside the stall.
            assert all(late[i] > early[i] for i in early), (early, late)
            assert repo.stats.counted_states(job) == {ItemState.SUCCEEDED: 2}
            with repo.engine.connect() as conn:
                attempts = conn.execute(
                    text("SELECT attempt FROM items WHERE job_id = :j"), {"j": job}
                ).scalars()
                assert sorted(attempts) == [1, 1]
    finally:
        redis_server.kill()
