"""An attempt that breaks inside the worker ends: its item is requeued with backoff and failed
at the attempt cap, its lease released, and it leaves the flight table (before, the task died,
the item stayed ``running`` and heartbeats kept its claim and lease alive for good).

Real Postgres and Redis. The engine is a stand-in: no real engine raises an arbitrary
exception inside the worker's stream loop, which is the fault this pins down (a bug of the
worker's own, or a body only an older version stored).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from backfill.config import Settings
from backfill.ledger import PoolSnapshot
from backfill.states import ItemState
from backfill.store import Repository
from tests.integration.pg_faults import kill_connections
from tests.integration.standin_engine import (
    StandInEngine,
    stand_in_dispatcher,
    stand_in_node,
    submit_completions,
)
from worker.dispatch import DispatchConfig

NODE = "n-fail"
BLOCK = 16  # the stand-in engine's pool: 64 blocks of 16


def _submit(repo: Repository) -> str:
    return submit_completions(repo, "t-fail", 1, 8)


def test_an_attempt_that_breaks_in_the_worker_is_retried_then_failed_and_its_lease_freed(
    settings: Settings,
) -> None:
    engine = StandInEngine(fail_after=1)
    with stand_in_node(settings, NODE, BLOCK) as (repo, ledger, aledger):
        job = _submit(repo)
        dispatcher = stand_in_dispatcher(
            DispatchConfig(node=NODE, max_attempts=3, idle_poll_s=0.05, observe_interval_s=0),
            engine,
            repo,
            aledger,
            BLOCK,
            max_sequence_tokens=512,
        )

        async def run_until_done() -> None:
            runner = asyncio.create_task(dispatcher.run())
            try:
                for _ in range(400):
                    await asyncio.sleep(0.05)
                    if repo.counted_states(job).get(ItemState.FAILED):
                        break
            finally:
                dispatcher.stop()
                await asyncio.wait_for(runner, 30)
                await aledger.aclose()

        asyncio.run(run_until_done())

        counts = repo.counted_states(job)
        assert counts.get(ItemState.FAILED) == 1, counts
        assert len(engine.streamed) == 3  # one stream per attempt, up to the cap
        (item,) = repo.items(job)
        assert item.error is not None
        assert json.loads(item.error)["code"] == "retries_exhausted"
        assert "a fault of the worker's own" in json.loads(item.error)["message"]
        assert dispatcher.in_flight == 0
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.batch_in_use == 0
        assert not snap.leases


def test_a_commit_the_store_drops_gives_its_leases_back_at_once(settings: Settings) -> None:
    """Postgres restarts between a hold and its commit: the commit fails on a dead
    connection, and the leases the worker took for it go back to the slack at once, not when
    their TTL (here two minutes) runs out. Before, they held the node's slack until then."""
    node = "n-commit"
    engine = StandInEngine()
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        job = submit_completions(repo, "t-commit", 4, 8)
        commit = repo.commit
        held_at_commit: list[int] = []

        def commit_after_a_restart(*args: Any, **kwargs: Any) -> list[int]:
            if not held_at_commit:
                snap = ledger.snapshot(node)
                held_at_commit.append(len(snap.leases) if snap is not None else -1)
                assert kill_connections(settings.database_url) >= 1
            return commit(*args, **kwargs)

        repo.commit = commit_after_a_restart  # type: ignore[method-assign]
        dispatcher = stand_in_dispatcher(
            DispatchConfig(node=node, idle_poll_s=0.05, observe_interval_s=0, lease_ttl_s=120),
            engine,
            repo,
            aledger,
            BLOCK,
        )
        after: list[PoolSnapshot | None] = []

        async def run_past_the_failed_commit() -> None:
            runner = asyncio.create_task(dispatcher.run())
            try:
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    if held_at_commit:
                        break
                # The dispatcher backs off a second after a store error; look inside it.
                await asyncio.sleep(0.5)
                after.append(ledger.snapshot(node))
            finally:
                dispatcher.stop()
                await asyncio.wait_for(runner, 30)
                await aledger.aclose()

        asyncio.run(run_past_the_failed_commit())

        assert held_at_commit == [4], "the commit was not reached with the four leases held"
        (snap,) = after
        assert snap is not None
        assert not snap.leases, f"leases of a failed commit still held: {snap.leases}"
        assert snap.batch_in_use == 0
        assert not engine.streamed  # nothing of the failed commit reached the engine
        assert sum(repo.counted_states(job).values()) == 4  # nothing lost
