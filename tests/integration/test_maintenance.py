"""Upkeep on real Postgres and Redis: the ledger rebuilt from Postgres after Redis lost it,
silent attempts reaped with their leases, expired jobs' in-flight items told to stop."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis
from sqlalchemy import text

from backfill.config import Settings
from backfill.engine.http import HttpEngine
from backfill.ledger import Denial, Lease, Ledger, NodePool
from backfill.maintenance import ensure_ledger, pool_policy, tick
from backfill.policy import Reason
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository, Start
from worker.node import wait_for_engine

CAPACITY, BLOCK = 64 * 128, 128


@pytest.fixture
def stores(settings: Settings) -> Iterator[tuple[Repository, Ledger]]:
    repo = Repository.connect(settings.database_url)
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace, pool_policy(settings))
    yield repo, ledger
    ledger.close()
    repo.close()


def _running_items(repo: Repository, ledger: Ledger, n: int, *, deadline_s: float = 3600) -> str:
    tenant = repo.tenants.create_tenant(f"t{datetime.now(UTC).timestamp()}")
    f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        tenant.id, f.id, "/v1/completions", "1h", datetime.now(UTC) + timedelta(seconds=deadline_s)
    )
    repo.ingest.insert_items(
        job.id, (NewItem(i, f"c{i}", json.dumps({"prompt": "x"}), 100) for i in range(n))
    )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    repo.nodes.upsert_node("n1", "http://127.0.0.1:1", "m", CAPACITY // BLOCK, BLOCK, 0)
    ensure_ledger(repo, ledger, max_preemptions=3)
    ledger.register_pool("n1", CAPACITY, BLOCK)
    starts = []
    opened = repo.claims.open_claim("n1", n, 30)
    for c in opened.items:
        lease = ledger.reserve("n1", "batch", 20, 100)
        assert isinstance(lease, Lease)
        starts.append(Start(c.id, c.attempt, lease.lease_id, lease.fencing_token, lease.tokens, 20))
    assert len(repo.claims.start_claim(opened, starts)) == n
    return job.id


def _flush(settings: Settings) -> None:
    client = redis.Redis.from_url(settings.redis_url)
    keys = list(client.scan_iter(match=f"{settings.redis_namespace}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def test_ledger_is_rebuilt_from_postgres_and_batch_waits_until_then(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    repo, ledger = stores
    _running_items(repo, ledger, 3)
    before = ledger.snapshot("n1")
    assert before is not None
    assert before.batch_in_use == 3 * 128
    top_fence = max(lease.fencing_token for lease in before.leases)

    _flush(settings)  # Redis lost everything (restart without persistence)
    assert not ledger.is_ready()
    ledger.register_pool("n1", CAPACITY, BLOCK)  # a worker re-registers before any rebuild
    denied = ledger.reserve("n1", "batch", 20, 100)
    assert isinstance(denied, Denial)
    assert denied.reason is Reason.LEDGER_REBUILDING

    report = ensure_ledger(repo, ledger, max_preemptions=3)
    assert report is not None
    assert report.restored == 3
    after = ledger.snapshot("n1")
    assert after is not None
    assert after.ready
    assert after.batch_in_use == before.batch_in_use
    fresh = ledger.reserve("n1", "batch", 20, 100)
    assert isinstance(fresh, Lease)
    assert fresh.fencing_token > top_fence
    assert ensure_ledger(repo, ledger, max_preemptions=3) is None  # intact: nothing to do


def test_a_rebuild_overtaken_by_a_newer_one_starts_over_instead_of_failing(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    """Two workers of one node start together on a ledger Redis lost: each rebuilds it, each
    under a new epoch. The one whose epoch was taken first registers the pool last and meets
    the newer epoch: before, its rebuild failed ('stale epoch') and the worker stopped at
    startup (seen in CI: `test_two_workers_on_one_node_never_over_reserve`). Now it starts
    over from a fresh read and the ledger ends whole, its leases all back."""
    repo, ledger = stores
    _running_items(repo, ledger, 3)
    before = ledger.snapshot("n1")
    assert before is not None
    _flush(settings)
    other = Ledger.from_url(settings.redis_url, settings.redis_namespace, pool_policy(settings))
    register = ledger._scripts["register_pool"]
    overtaken: list[int] = []

    def register_after_the_other_rebuild(*args: object, **kwargs: object) -> object:
        if not overtaken:
            # The other worker's whole rebuild lands between this one's epoch and its
            # registration.
            report = ensure_ledger(repo, other, max_preemptions=3)
            assert report is not None
            overtaken.append(report.epoch)
        return register(*args, **kwargs)

    ledger._scripts["register_pool"] = register_after_the_other_rebuild
    try:
        report = ensure_ledger(repo, ledger, max_preemptions=3)
    finally:
        ledger._scripts["register_pool"] = register
        other.close()
    assert overtaken, "the race was not staged"
    # Whole, whoever finished it: ready, every lease back, new fences past the newest epoch.
    after = ledger.snapshot("n1")
    assert after is not None
    assert after.ready
    assert after.batch_in_use == before.batch_in_use
    assert report is None or report.epoch > overtaken[0]
    fresh = ledger.reserve("n1", "batch", 20, 100)
    assert isinstance(fresh, Lease)
    assert ensure_ledger(repo, ledger, max_preemptions=3) is None


def test_a_node_closed_for_a_lost_lease_is_rebuilt_alone_while_the_others_admit(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    repo, ledger = stores
    _running_items(repo, ledger, 3)
    repo.nodes.upsert_node("n2", "http://127.0.0.1:2", "m", CAPACITY // BLOCK, BLOCK, 0)
    ledger.register_pool("n2", CAPACITY, BLOCK)
    held = ledger.reserve("n2", "batch", 20, 100)
    assert isinstance(held, Lease)
    before = ledger.snapshot("n1")
    assert before is not None
    client = redis.Redis.from_url(settings.redis_url)
    n2_ready = client.get(ledger.keys.node("n2").ready)
    assert n2_ready is not None
    # One of n1's leases went missing (a replica promoted before its write): its holder
    # closes n1.
    lost = before.leases[0]
    keys = ledger.keys.node("n1")
    client.hdel(keys.leases, lost.lease_id)
    client.hincrby(keys.pool, "b_used", -lost.tokens)
    assert ledger.mark_incomplete("n1")
    assert ledger.incomplete_nodes() == {"n1"}
    assert not ledger.is_ready()

    report = ensure_ledger(repo, ledger, max_preemptions=3)
    assert report is not None
    assert report.restored == 1  # the lost one; n1's other two were still there
    after = ledger.snapshot("n1")
    assert after is not None
    assert after.ready
    assert after.batch_in_use == before.batch_in_use
    # n2 was never closed: its marker is the one it had, and its lease was not touched.
    assert client.get(ledger.keys.node("n2").ready) == n2_ready
    n2 = ledger.snapshot("n2")
    assert n2 is not None
    assert [x.lease_id for x in n2.leases] == [held.lease_id]
    client.close()
    assert ledger.is_ready()
    assert ensure_ledger(repo, ledger, max_preemptions=3) is None


def test_a_node_a_racing_rebuild_left_out_of_the_ledger_is_still_rebuilt(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    repo, ledger = stores
    _running_items(repo, ledger, 2)
    client = redis.Redis.from_url(settings.redis_url)
    # n3 registers while a rebuild runs that read Postgres before it: its worker's own
    # rebuild gave it a pool and a marker, the racing one's clean-up dropped it as a member.
    repo.nodes.upsert_node("n3", "http://127.0.0.1:3", "m", CAPACITY // BLOCK, BLOCK, 0)
    ensure_ledger(repo, ledger, max_preemptions=3)
    ledger.register_pool("n3", CAPACITY, BLOCK)
    client.srem(ledger.keys.members, "n3")
    n3 = ledger.reserve("n3", "batch", 20, 100)
    assert isinstance(n3, Lease)
    # Its lease then goes missing (its shard failed over): the holder closes it, and the
    # ledger must see a rebuild due, though n3 was no member.
    client.hdel(ledger.keys.node("n3").leases, n3.lease_id)
    client.hincrby(ledger.keys.node("n3").pool, "b_used", -n3.tokens)
    ledger.mark_incomplete("n3")
    assert not ledger.is_ready()
    assert ledger.incomplete_nodes() == {"n3"}

    # A full rebuild given only n1 (n3 registered after it read Postgres) keeps n3, which
    # has a pool, as a member: the next rebuild takes it.
    report = ledger.rebuild(
        [NodePool("n1", CAPACITY, BLOCK)], [], repo.recovery.next_ledger_epoch()
    )
    assert report.unlisted == ("n3",)
    assert ledger.incomplete_nodes() == {"n3"}
    client.close()
    assert ensure_ledger(repo, ledger, max_preemptions=3) is not None
    assert ledger.is_ready()
    snap = ledger.snapshot("n3")
    assert snap is not None
    assert snap.ready


def test_silent_attempts_are_requeued_and_their_leases_released(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    repo, ledger = stores
    job = _running_items(repo, ledger, 2)
    with repo.engine.begin() as conn:
        conn.execute(text("UPDATE items SET lease_expires_at = now() - interval '1 s'"))
    report = tick(repo, ledger, settings)
    assert report.requeued_lost == 2
    assert report.released == 2
    snap = ledger.snapshot("n1")
    assert snap is not None
    assert snap.batch_in_use == 0
    assert repo.stats.counted_states(job) == {ItemState.QUEUED: 2}


def test_expiry_tells_in_flight_workers_to_stop(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    repo, ledger = stores
    job = _running_items(repo, ledger, 2, deadline_s=3600)
    with ledger.listen_preemptions("n1") as listener:
        with repo.engine.begin() as conn:
            conn.execute(text("UPDATE jobs SET deadline = now() - interval '1 s'"))
        report = tick(repo, ledger, settings)
        assert report.expired_jobs == [job]
        told = {listener.get(timeout=2.0), listener.get(timeout=2.0)}
    leases = {r for r in told if r}
    assert len(leases) == 2
    assert repo.jobs.get_job(None, job).state is JobState.EXPIRED
    assert repo.stats.counted_states(job) == {ItemState.EXPIRED: 2}


def test_a_worker_whose_engine_is_down_says_so_and_keeps_trying(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def scenario() -> object:
        stop = asyncio.Event()
        async with HttpEngine("http://127.0.0.1:9") as engine:
            waiter = asyncio.create_task(wait_for_engine(engine, stop, retry_s=0.1))
            await asyncio.sleep(0.5)
            assert not waiter.done(), "gave up instead of retrying"
            stop.set()
            return await waiter

    with caplog.at_level(logging.WARNING, logger="backfill.worker"):
        assert asyncio.run(scenario()) is None
    retries = [r for r in caplog.records if "not answering" in r.getMessage()]
    assert len(retries) >= 2
    assert "127.0.0.1:9" in retries[0].getMessage()
