"""Held claims on a real Postgres: a hold opens its attempts, a commit starts what the worker
dispatches and gives back the rest, and every invariant of a plain claim holds."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from backfill.config import libpq_url
from backfill.states import ItemState, JobState
from backfill.store import ClaimedItem, Finish, JobRecord, NewItem, Repository, Start


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    r = Repository.connect(database_url, pool_size=10)
    yield r
    r.close()


def _job(repo: Repository, n: int, tenant: str | None = None) -> JobRecord:
    """An in-progress job of ``n`` items, of a new tenant (named ``tenant``, or by the time)."""
    tenant_id = repo.create_tenant(tenant or f"t{datetime.now(UTC).timestamp()}").id
    f = repo.create_file(tenant_id, "batch", "in.jsonl", b"{}")
    job = repo.create_job(
        tenant_id, f.id, "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.insert_items(
        job.id, (NewItem(i, f"req-{i}", '{"messages": []}', 16, 100, 128) for i in range(n))
    )
    repo.move_job(job.id, JobState.IN_PROGRESS)
    return job


def _start(held: ClaimedItem, fence: int) -> Start:
    return Start(held.id, held.attempt, f"lease-{fence}", fence, 128, 20)


def _attempt_rows(url: str, item_id: int) -> list[tuple[object, ...]]:
    with psycopg.connect(libpq_url(url)) as conn:
        return conn.execute(
            "SELECT attempt, node, lease_id, fencing_token, outcome, ended_at IS NULL "
            "FROM attempts WHERE item_id = %s ORDER BY attempt",
            (item_id,),
        ).fetchall()


def _assert_counters_match(repo: Repository, job_id: str) -> None:
    counts = repo.get_job(None, job_id).counts
    truth = repo.counted_states(job_id)
    for state in ItemState:
        assert counts.count(state) == truth.get(state, 0), state


def test_a_hold_reserves_its_items_and_opens_their_attempts(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 3)
    held = repo.hold_claim("n1", 2, 30)
    assert [h.attempt for h in held] == [1, 1]
    # Held items are reserved in the job's status, not queued.
    counts = repo.get_job(None, job.id).counts
    assert (counts.count(ItemState.RESERVED), counts.count(ItemState.QUEUED)) == (2, 1)
    assert _attempt_rows(database_url, held[0].id) == [(1, "n1", None, None, None, True)]
    _assert_counters_match(repo, job.id)


def test_commit_starts_the_dispatched_holds_and_gives_back_the_rest(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 3)
    a, b, _still_held = repo.hold_claim("n1", 3, 30)
    started = repo.commit([_start(a, 7)], 30, released=[(b.id, b.attempt)], detail="no slack")
    assert started == [a.id]
    assert _attempt_rows(database_url, a.id) == [(1, "n1", "lease-7", 7, None, True)]
    assert _attempt_rows(database_url, b.id) == [(1, "n1", None, None, "released", False)]
    counts = repo.get_job(None, job.id).counts
    assert counts.count(ItemState.RUNNING) == 1
    assert counts.count(ItemState.QUEUED) == 1
    assert counts.count(ItemState.RESERVED) == 1  # c: still held
    # The started attempt finishes under its fencing token; the released item is claimable.
    done = Finish(a.id, a.attempt, 7, ItemState.SUCCEEDED, result="{}", output_tokens=3)
    assert repo.finish([done]) == [a.id]
    assert _attempt_rows(database_url, a.id) == [(1, "n1", "lease-7", 7, "succeeded", False)]
    again = repo.hold_claim("n2", 5, 30)
    assert [(h.id, h.attempt) for h in again] == [(b.id, 2)]
    _assert_counters_match(repo, job.id)


def test_a_commit_of_a_stale_hold_starts_nothing(repo: Repository) -> None:
    _job(repo, 1)
    (held,) = repo.hold_claim("n1", 1, 30)
    assert repo.commit([_start(held, 1)], 30) == [held.id]
    # The same hold committed again (a retry), or an older attempt's: nothing moves.
    assert repo.commit([_start(held, 2)], 30) == []
    stale = Start(held.id, held.attempt - 1, "old", 3, 128, 20)
    assert repo.commit([stale], 30, released=[(held.id, held.attempt - 1)]) == []


def test_concurrent_holders_never_share_an_item(repo: Repository) -> None:
    job = _job(repo, 2000)
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def holder(node: str) -> None:
        fence = 0
        try:
            while batch := repo.hold_claim(node, 37, 30):
                with lock:
                    seen.extend(h.id for h in batch)
                # Commit half, give back none: every hold ends started or still held.
                starts = []
                for h in batch:
                    fence += 1
                    starts.append(_start(h, fence))
                assert sorted(repo.commit(starts, 30)) == sorted(h.id for h in batch)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=holder, args=(f"n{k}",)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [i for i, n in Counter(seen).items() if n > 1] == []
    assert len(seen) == 2000
    assert repo.get_job(None, job.id).counts.count(ItemState.RUNNING) == 2000
    _assert_counters_match(repo, job.id)


def test_a_hold_never_committed_lapses_and_the_reaper_queues_it_again(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 1)
    (held,) = repo.hold_claim("n1", 1, 30)
    with psycopg.connect(libpq_url(database_url)) as conn:
        conn.execute("UPDATE items SET lease_expires_at = now() - interval '1 s'")
    lost = repo.reap_lost(max_lost_runs=1)
    # Never started: requeued, and not counted as a lost run (the cap is 1).
    assert [(x.item_id, x.failed) for x in lost] == [(held.id, False)]
    assert _attempt_rows(database_url, held.id) == [(1, "n1", None, None, "lost", False)]
    # The late commit of the lapsed hold starts nothing; the next hold takes attempt 2.
    assert repo.commit([_start(held, 1)], 30) == []
    (again,) = repo.hold_claim("n2", 1, 30)
    assert (again.id, again.attempt) == (held.id, 2)
    assert repo.commit([_start(held, 2)], 30) == []
    assert repo.commit([_start(again, 3)], 30) == [held.id]
    _assert_counters_match(repo, job.id)


def test_a_cancel_ends_held_items_at_once_and_their_commit_starts_nothing(
    repo: Repository,
) -> None:
    job = _job(repo, 3)
    a, b = repo.hold_claim("n1", 2, 30)
    repo.commit([_start(a, 1)], 30)
    # Cancelling ends queued and held items now (no lease TTL to wait out); running ones
    # are left to their workers to stop.
    ended = repo.end_items(job.id, ItemState.CANCELLED, only_unstarted=True)
    assert [(r.item_id, r.lease_id) for r in ended] == [(b.id, None)]
    assert repo.commit([_start(b, 2)], 30) == []
    counts = repo.get_job(None, job.id).counts
    assert counts.count(ItemState.CANCELLED) == 2
    assert counts.count(ItemState.RUNNING) == 1
    _assert_counters_match(repo, job.id)
