"""An item whose worker process dies while running it, again and again (a poison request that
crashes the worker), fails at the attempt cap instead of being requeued forever.

Each death is played on real Postgres and Redis as the reaper sees one: the item is claimed
and started under a ledger lease, its attempt stops heartbeating (its lease expiry is moved
into the past, as the silence of a dead worker leaves it), and the maintenance tick reaps it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text

from backfill.config import Settings
from backfill.ledger import Lease, Ledger
from backfill.maintenance import TickReport, ensure_ledger, pool_policy, tick
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository, Start

CAP = 3
CAPACITY, BLOCK = 64 * 128, 128


@pytest.fixture
def stores(settings: Settings) -> Iterator[tuple[Repository, Ledger]]:
    repo = Repository.connect(settings.database_url)
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace, pool_policy(settings))
    repo.nodes.upsert_node("n1", "http://127.0.0.1:1", "m", CAPACITY // BLOCK, BLOCK, 0)
    ensure_ledger(repo, ledger, max_preemptions=3)
    ledger.register_pool("n1", CAPACITY, BLOCK)
    yield repo, ledger
    ledger.close()
    repo.close()


def _job(repo: Repository, n: int) -> str:
    tenant = repo.tenants.create_tenant(f"t{datetime.now(UTC).timestamp()}")
    job = repo.jobs.create_job(
        tenant.id, "file-x", "/v1/completions", "1h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(
        job.id,
        (NewItem(i, f"c{i}", json.dumps({"prompt": "x"}), 100) for i in range(n)),
        start_reason=lambda k: f"{k} requests accepted",
    )
    return job.id


def _die(repo: Repository, ledger: Ledger, settings: Settings, *, started: bool) -> TickReport:
    """Claim every claimable item, start it (or not), and let its worker fall silent."""
    opened = repo.claims.open_claim("n1", 10, 30)
    claimed = opened.items
    assert claimed
    starts = []
    if started:
        for c in claimed:
            lease = ledger.reserve("n1", "batch", 20, 100)
            assert isinstance(lease, Lease)
            starts.append(
                Start(c.id, c.attempt, lease.lease_id, lease.fencing_token, lease.tokens, 20)
            )
    # Unstarted, each is held (reserved under its attempt), as a worker holds what it refuses.
    held = [] if started else [(c.id, c.attempt) for c in claimed]
    assert len(repo.claims.start_claim(opened, starts, held)) == len(starts)
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE items SET lease_expires_at = now() - interval '1 s' "
                "WHERE state IN ('reserved', 'running')"
            )
        )
    return tick(repo, ledger, settings)


def test_an_item_that_keeps_killing_its_worker_fails_at_the_attempt_cap(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    repo, ledger = stores
    s = settings.model_copy(update={"max_attempts_per_item": CAP})
    job = _job(repo, 1)
    for _ in range(CAP - 1):
        report = _die(repo, ledger, s, started=True)
        assert (report.requeued_lost, report.failed_lost) == (1, 0)
        assert repo.stats.counted_states(job) == {ItemState.QUEUED: 1}
    # Lost before it ever reached the engine: the item did not kill anything; not counted.
    for _ in range(2):
        report = _die(repo, ledger, s, started=False)
        assert (report.requeued_lost, report.failed_lost) == (1, 0)
    report = _die(repo, ledger, s, started=True)
    assert (report.requeued_lost, report.failed_lost) == (0, 1)
    assert report.released == 1

    [item] = repo.items.items(job)
    assert item.state is ItemState.FAILED
    assert item.error is not None
    error = json.loads(item.error)
    assert error["code"] == "worker_lost"
    assert f"worker lost {CAP} times" in error["message"]
    snap = ledger.snapshot("n1")
    assert snap is not None
    assert snap.batch_in_use == 0
    counts = repo.jobs.get_job(None, job).counts
    assert counts.count(ItemState.FAILED) == 1 == counts.total
    # Finalized as OpenAI does: it ran, so it completed, with every request counted failed.
    assert repo.jobs.get_job(None, job).state is JobState.COMPLETED
    assert repo.claims.open_claim("n1", 10, 30).items == []


def test_items_lost_fewer_times_than_the_cap_are_requeued_with_their_neighbours(
    settings: Settings, stores: tuple[Repository, Ledger]
) -> None:
    repo, ledger = stores
    s = settings.model_copy(update={"max_attempts_per_item": CAP})
    job = _job(repo, 4)
    report = _die(repo, ledger, s, started=True)
    assert (report.requeued_lost, report.failed_lost) == (4, 0)
    truth = repo.stats.counted_states(job)
    assert truth == {ItemState.QUEUED: 4}
    counts = repo.jobs.get_job(None, job).counts
    assert counts.count(ItemState.QUEUED) == 4
    assert counts.count(ItemState.RUNNING) == 0
