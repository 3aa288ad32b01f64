"""An attempt that breaks inside the worker ends: its item is requeued with backoff and failed
at the attempt cap, its lease released, and it leaves the flight table (before, the task died,
the item stayed ``running`` and heartbeats kept its claim and lease alive for good).

Real Postgres and Redis. The engine is a stand-in: no real engine raises an arbitrary
exception inside the worker's stream loop, which is the fault this pins down (a bug of the
worker's own, or a body only an older version stored).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from backfill.config import Settings
from backfill.errors import LedgerError, LedgerUnavailable
from backfill.ledger import AsyncLedger, Ledger, PoolSnapshot
from backfill.states import ItemState
from backfill.store import Repository
from tests.integration.pg_faults import kill_connections
from tests.integration.standin_engine import (
    StandInEngine,
    all_succeeded,
    quick_dispatcher,
    run_until,
    stand_in_node,
    submit_completions,
)
from worker.dispatch import NodeDispatcher

NODE = "n-fail"
BLOCK = 16  # the stand-in engine's pool: 64 blocks of 16


def _submit(repo: Repository) -> str:
    return submit_completions(repo, "t-fail", 1, 8)


def _pool_before_stop(
    dispatcher: NodeDispatcher,
    stores: tuple[Repository, Ledger, AsyncLedger],
    node: str,
    done: Callable[[], bool],
    linger_s: float = 0.0,
) -> PoolSnapshot | None:
    """Run ``dispatcher`` until ``done()`` (10 s at most) and ``linger_s`` more, then stop it:
    ``node``'s pool as it stood just before the stop."""
    _, ledger, aledger = stores
    before_stop: list[PoolSnapshot | None] = []
    run_until(
        dispatcher,
        aledger,
        done,
        polls=200,
        linger_s=linger_s,
        before_stop=lambda: before_stop.append(ledger.snapshot(node)),
    )
    (snap,) = before_stop
    return snap


def _nothing_held(snap: PoolSnapshot | None, what: str) -> None:
    """``snap``, a node's pool, holds no lease and no batch tokens (``what``: what a lease
    left held would say)."""
    assert snap is not None
    assert not snap.leases, f"{what}: {snap.leases}"
    assert snap.batch_in_use == 0


def test_an_attempt_that_breaks_in_the_worker_is_retried_then_failed_and_its_lease_freed(
    settings: Settings,
) -> None:
    engine = StandInEngine(fail_after=1)
    with stand_in_node(settings, NODE, BLOCK) as (repo, ledger, aledger):
        job = _submit(repo)
        dispatcher = quick_dispatcher(
            NODE, engine, repo, aledger, BLOCK, max_sequence_tokens=512, max_attempts=3
        )
        run_until(
            dispatcher, aledger, lambda: bool(repo.stats.counted_states(job).get(ItemState.FAILED))
        )

        counts = repo.stats.counted_states(job)
        assert counts.get(ItemState.FAILED) == 1, counts
        assert len(engine.streamed) == 3  # one stream per attempt, up to the cap
        (item,) = repo.items.items(job)
        assert item.error is not None
        assert json.loads(item.error)["code"] == "retries_exhausted"
        assert "a fault of the worker's own" in json.loads(item.error)["message"]
        assert dispatcher.in_flight == 0
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.batch_in_use == 0
        assert not snap.leases


def test_a_commit_the_store_drops_gives_its_leases_back_at_once(settings: Settings) -> None:
    """Postgres restarts while a claim is open: its start fails on a dead connection, and
    the leases the worker took for it go back to the slack at once, not when their TTL (here
    two minutes) runs out. Before, they held the node's slack until then."""
    node = "n-commit"
    engine = StandInEngine()
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        job = submit_completions(repo, "t-commit", 4, 8)
        start_claim = repo.claims.start_claim
        held_at_commit: list[int] = []

        def start_after_a_restart(*args: Any, **kwargs: Any) -> list[int]:
            if not held_at_commit:
                snap = ledger.snapshot(node)
                held_at_commit.append(len(snap.leases) if snap is not None else -1)
                assert kill_connections(settings.database_url) >= 1
            return start_claim(*args, **kwargs)

        repo.claims.start_claim = start_after_a_restart  # type: ignore[method-assign]
        dispatcher = quick_dispatcher(node, engine, repo, aledger, BLOCK, lease_ttl_s=120)
        # The dispatcher backs off a second after a store error; look inside it.
        stores = (repo, ledger, aledger)
        snap = _pool_before_stop(dispatcher, stores, node, lambda: bool(held_at_commit), 0.5)

        assert held_at_commit == [4], "the commit was not reached with the four leases held"
        _nothing_held(snap, "leases of a failed commit still held")
        assert not engine.streamed  # nothing of the failed commit reached the engine
        assert sum(repo.stats.counted_states(job).values()) == 4  # nothing lost


def test_a_claim_that_breaks_in_the_worker_does_not_stop_the_node_nor_abandon_its_flights(
    settings: Settings,
) -> None:
    """A fault of the worker's own while it claims (here the second claim raises): before,
    it ended the dispatch loop with no drain, so the node stopped feeding its engine for good
    and the items in flight were left to run on past their drain, with their leases cleaned
    up (if at all) after the ledger client had closed. Now the fault is logged, the loop backs
    off and claims again, and the job completes with nothing left held."""
    node = "n-claim-fault"
    engine = StandInEngine(hold_s=0.5)
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        job = submit_completions(repo, "t-claim-fault", 6, 8)
        open_claim = repo.claims.open_claim
        calls: list[int] = []
        held_at_fault: list[int] = []

        def second_claim_breaks(*args: Any, **kwargs: Any) -> Any:
            calls.append(len(calls))
            if len(calls) == 2:
                held_at_fault.append(dispatcher.in_flight)
                raise RuntimeError("a fault of the worker's own")
            return open_claim(*args, **kwargs)

        repo.claims.open_claim = second_claim_breaks  # type: ignore[method-assign]
        dispatcher = quick_dispatcher(node, engine, repo, aledger, BLOCK, claim_batch=2)
        # run_until fails if the dispatch loop ends on the fault.
        run_until(dispatcher, aledger, all_succeeded(repo, job, 6))

        assert held_at_fault, "the second claim was never made"
        assert held_at_fault[0] > 0, "nothing was in flight at the fault"
        assert repo.stats.counted_states(job) == {ItemState.SUCCEEDED: 6}
        _nothing_held(ledger.snapshot(node), "leases still held after the fault")


def test_a_lease_whose_release_failed_is_released_when_the_dispatcher_stops(
    settings: Settings,
) -> None:
    """The ledger refuses the release after an item's result is durable (a Redis blip):
    before, the failure was swallowed and the lease held the node's slack until the reaper
    reclaimed it (a node whose workers restart with no reaper running stalled on it). Now
    the dispatcher keeps every lease it holds until it is released, and releases what is
    left when it stops."""
    node = "n-release"
    engine = StandInEngine()
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        job = submit_completions(repo, "t-release", 1, 8)
        release_many = aledger.release_many
        refused: list[int] = []

        async def first_release_fails(held: Any) -> Any:
            if not refused:
                refused.append(len(held))
                raise LedgerError("the ledger did not answer")
            return await release_many(held)

        aledger.release_many = first_release_fails  # type: ignore[method-assign]
        dispatcher = quick_dispatcher(node, engine, repo, aledger, BLOCK, lease_ttl_s=120)
        succeeded = all_succeeded(repo, job, 1)
        stores = (repo, ledger, aledger)
        held = _pool_before_stop(dispatcher, stores, node, lambda: succeeded() and bool(refused))

        assert refused == [1], "the release was not refused once"
        assert held is not None
        assert len(held.leases) == 1, "the refused lease was not held"
        _nothing_held(ledger.snapshot(node), "a lease outlived its dispatcher")


def test_reservations_whose_reply_was_lost_go_back_to_the_slack_at_once(
    settings: Settings,
) -> None:
    """Redis grants a claim's reservations and the reply is lost with the connection: the
    worker cannot tell what was granted and never learned the fencing tokens. Before, those
    leases held the node's slack until their TTL (here two minutes) ran out; now the worker
    gives them back by lease id and owner at once, and the items, untouched, run later."""
    node = "n-lost-reply"
    engine = StandInEngine()
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        job = submit_completions(repo, "t-lost-reply", 4, 8)
        reserve_many = aledger.reserve_many
        granted: list[int] = []

        async def reply_lost(requests: Any) -> Any:
            results = await reserve_many(requests)
            if not granted:
                granted.append(sum(1 for r in results if not hasattr(r, "reason")))
                raise LedgerUnavailable("connection lost before the reply")
            return results

        aledger.reserve_many = reply_lost  # type: ignore[method-assign]
        dispatcher = quick_dispatcher(node, engine, repo, aledger, BLOCK, lease_ttl_s=120)
        # Looked at right after the lost reply, before the worker's retry (a second's backoff).
        stores = (repo, ledger, aledger)
        snap = _pool_before_stop(dispatcher, stores, node, lambda: bool(granted), 0.3)
        assert granted == [4], "the reservations were not granted before the reply was lost"
        _nothing_held(snap, "leases of a lost reply still held")
        assert not engine.streamed
        # Untouched by the failed claim: still queued, no attempt spent.
        assert repo.stats.counted_states(job) == {ItemState.QUEUED: 4}
