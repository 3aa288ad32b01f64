"""Open claims on a real Postgres: the claim keeps its items locked, unwritten, while the
worker counts and reserves; its start writes each item and its attempt once; everything it
does not start is left as it was; and the invariants of every claim hold (no item to two
claimers, attempts fenced, counters exact, a cancel never loses to a start)."""

from __future__ import annotations

import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime

import psycopg
import pytest

from backfill.config import libpq_url
from backfill.errors import StaleWrite, StoreUnavailable
from backfill.finalize import cancel_job
from backfill.states import ItemState, JobState
from backfill.store import ClaimedItem, Finish, JobRecord, Repository, Start
from tests.integration.test_repository import _assert_counters_match, _job


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    r = Repository.connect(database_url, pool_size=10)
    yield r
    r.close()


def _start(item: ClaimedItem, fence: int) -> Start:
    return Start(item.id, item.attempt, f"lease-{fence}", fence, 128, 20)


def _rows(url: str, item_id: int) -> tuple[tuple[object, ...], list[tuple[object, ...]]]:
    """The item's (state, attempt, node, lease_id, fencing_token) and its attempt rows."""
    with psycopg.connect(libpq_url(url)) as conn:
        item = conn.execute(
            "SELECT state, attempt, node, lease_id, fencing_token FROM items WHERE id = %s",
            (item_id,),
        ).fetchone()
        attempts = conn.execute(
            "SELECT attempt, node, lease_id, fencing_token, outcome FROM attempts "
            "WHERE item_id = %s ORDER BY attempt",
            (item_id,),
        ).fetchall()
    assert item is not None
    return tuple(item), [tuple(a) for a in attempts]


def _prompt_tokens(url: str, job_id: str) -> int:
    with psycopg.connect(libpq_url(url)) as conn:
        row = conn.execute(
            "SELECT coalesce(sum(prompt_tokens), 0) FROM items WHERE job_id = %s", (job_id,)
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_an_open_claim_locks_its_items_and_writes_nothing(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 5)
    first = repo.claims.open_claim("n1", 3, 30)
    try:
        assert [c.attempt for c in first.items] == [1, 1, 1]
        # Nothing written while it is open: still queued, no attempt spent, no attempt row.
        assert _rows(database_url, first.items[0].id) == (("queued", 0, None, None, None), [])
        assert repo.jobs.get_job(None, job.id).counts.count(ItemState.QUEUED) == 5
        # Another claimer skips the locked items.
        second = repo.claims.open_claim("n2", 5, 30)
        assert {c.id for c in second.items}.isdisjoint(c.id for c in first.items)
        assert len(second.items) == 2
        repo.claims.drop_claim(second)
    finally:
        repo.claims.drop_claim(first)
    # Dropped: every item claimable again, as it was.
    again = repo.claims.open_claim("n3", 10, 30)
    assert len(again.items) == 5
    assert all(c.attempt == 1 for c in again.items)
    repo.claims.drop_claim(again)
    _assert_counters_match(repo, job.id)


def test_the_start_writes_each_item_once_holds_the_refused_and_leaves_the_rest(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 3)
    claim = repo.claims.open_claim("n1", 3, 30)
    a, b, c = claim.items
    started = repo.claims.start_claim(claim, [_start(a, 7)], held=[(b.id, b.attempt)])
    assert started == [a.id]
    assert not claim.open
    assert _rows(database_url, a.id) == (
        ("running", 1, "n1", "lease-7", 7),
        [(1, "n1", "lease-7", 7, None)],
    )
    # Held to be settled by the worker, as a hold: reserved under the new attempt.
    assert _rows(database_url, b.id) == (
        ("reserved", 1, "n1", None, None),
        [(1, "n1", None, None, None)],
    )
    # Left: untouched, no attempt spent.
    assert _rows(database_url, c.id) == (("queued", 0, None, None, None), [])
    counts = repo.jobs.get_job(None, job.id).counts
    assert [counts.count(s) for s in (ItemState.RUNNING, ItemState.RESERVED, ItemState.QUEUED)] == [
        1,
        1,
        1,
    ]
    _assert_counters_match(repo, job.id)
    # The job's prompt tokens take the started item's exact count (20) in place of what
    # ingest stored (100): what `backfill status` shows (it stayed at ingest's figure).
    assert counts.prompt_tokens == 100 + 100 + 20 == _prompt_tokens(database_url, job.id)
    # The started attempt finishes under its fencing token; the held one settles as a hold.
    done = Finish(a.id, a.attempt, 7, ItemState.SUCCEEDED, result="{}", output_tokens=3)
    assert repo.items.finish([done]) == [a.id]
    repo.items.give_back(b.id, b.attempt, ItemState.DEFERRED, retry_after_s=60, detail="no slack")
    assert _rows(database_url, b.id)[1] == [(1, "n1", None, None, "deferred")]
    (again,) = repo.claims.open_claim("n2", 5, 30).items  # b is deferred: only c is claimable
    assert (again.id, again.attempt) == (c.id, 1)
    _assert_counters_match(repo, job.id)


def test_a_held_item_never_settled_lapses_and_the_reaper_queues_it_again(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 1)
    claim = repo.claims.open_claim("n1", 1, 30)
    (held,) = claim.items
    assert repo.claims.start_claim(claim, [], held=[(held.id, held.attempt)]) == []
    with psycopg.connect(libpq_url(database_url)) as conn:
        conn.execute("UPDATE items SET lease_expires_at = now() - interval '1 s'")
    lost = repo.recovery.reap_lost(max_lost_runs=1)
    # Never started: requeued, and not counted as a lost run (the cap is 1).
    assert [(x.item_id, x.failed) for x in lost] == [(held.id, False)]
    assert _rows(database_url, held.id)[1] == [(1, "n1", None, None, "lost")]
    # The worker's late settle of the lapsed hold is fenced out; the next claim takes
    # attempt 2.
    with pytest.raises(StaleWrite):
        repo.items.give_back(held.id, held.attempt, ItemState.DEFERRED, retry_after_s=60)
    claim = repo.claims.open_claim("n2", 1, 30)
    (again,) = claim.items
    assert (again.id, again.attempt) == (held.id, 2)
    assert repo.claims.start_claim(claim, [_start(again, 3)]) == [held.id]
    _assert_counters_match(repo, job.id)


def test_an_item_claimed_again_starts_under_the_next_attempt(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 1)
    claim = repo.claims.open_claim("n1", 1, 30)
    (first,) = claim.items
    assert repo.claims.start_claim(claim, [_start(first, 1)]) == [first.id]
    repo.items.preempt(first.id, first.attempt, 1, partial_output="abc", partial_tokens=2)
    claim = repo.claims.open_claim("n2", 1, 30)
    (second,) = claim.items
    assert (second.attempt, second.partial_output, second.preemptions) == (2, "abc", 1)
    assert repo.claims.start_claim(claim, [_start(second, 2)]) == [first.id]
    # The first attempt's late finish is fenced out; the second's applies.
    late = Finish(first.id, 1, 1, ItemState.SUCCEEDED, result="{}", output_tokens=1)
    assert repo.items.finish([late]) == []
    done = Finish(first.id, 2, 2, ItemState.SUCCEEDED, result="{}", output_tokens=4)
    assert repo.items.finish([done]) == [first.id]
    assert [a[4] for a in _rows(database_url, first.id)[1]] == ["preempted", "succeeded"]
    _assert_counters_match(repo, job.id)


def test_a_claim_refuses_a_start_of_an_item_it_did_not_pick(repo: Repository) -> None:
    _job(repo, 2)
    claim = repo.claims.open_claim("n1", 1, 30)
    (item,) = claim.items
    stranger = Start(item.id + 1, 1, "x", 1, 128, 20)
    with pytest.raises(ValueError, match="not of this claim"):
        repo.claims.start_claim(claim, [stranger])
    assert not claim.open  # dropped: nothing written
    assert len(repo.claims.open_claim("n2", 5, 30).items) == 2


def test_a_cancel_waits_for_an_open_claim_and_its_start_starts_nothing(
    repo: Repository, database_url: str
) -> None:
    """A cancel while a claim is open: the job leaves in_progress at once, its unstarted
    items wait on the claim's locks; the start then moves none of them (the job is no longer
    in progress) and the cancel ends them all: nothing of a cancelled job starts."""
    job = _job(repo, 3)
    claim = repo.claims.open_claim("n1", 3, 30)
    cancelled: list[JobRecord] = []
    canceller = threading.Thread(
        target=lambda: cancelled.append(cancel_job(repo, job.tenant_id, job.id))
    )
    canceller.start()
    # The cancel's first step (the job leaves in_progress) commits on its own; on a loaded
    # machine that took longer than the half second this test once slept for it.
    deadline = time.monotonic() + 60
    while repo.jobs.get_job(None, job.id).state is not JobState.CANCELLING:
        assert time.monotonic() < deadline, "the job never left in_progress in 60 s"
        assert canceller.is_alive(), f"the cancel ended before the claim's start: {cancelled}"
        time.sleep(0.02)
    # Its items are locked by the open claim: the cancel waits for them.
    time.sleep(0.2)
    assert canceller.is_alive(), "the cancel did not wait for the open claim's locks"
    started = repo.claims.start_claim(claim, [_start(c, k) for k, c in enumerate(claim.items, 1)])
    canceller.join(10)
    assert started == []
    assert cancelled
    assert cancelled[0].state is JobState.CANCELLED
    assert repo.stats.counted_states(job.id) == {ItemState.CANCELLED: 3}
    assert _rows(database_url, claim.items[0].id)[1] == []  # no attempt was opened
    _assert_counters_match(repo, job.id)


def test_a_claim_left_open_too_long_loses_its_transaction_and_writes_nothing(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 2)
    claim = repo.claims.open_claim("n1", 2, 0.3)  # ends 0.3 s idle at the latest
    time.sleep(1.0)
    with pytest.raises(StoreUnavailable):
        repo.claims.start_claim(claim, [_start(c, k) for k, c in enumerate(claim.items, 1)])
    assert not claim.open
    assert _rows(database_url, claim.items[0].id) == (("queued", 0, None, None, None), [])
    # The pool dropped the dead connection: the next claim works.
    again = repo.claims.open_claim("n2", 5, 30)
    assert len(again.items) == 2
    repo.claims.drop_claim(again)
    _assert_counters_match(repo, job.id)


def test_open_claims_share_a_node_between_tenants(repo: Repository) -> None:
    stamp = datetime.now(UTC).timestamp()
    a = _job(repo, 20, tenant=repo.tenants.create_tenant(f"a{stamp}").id)
    b = _job(repo, 20, tenant=repo.tenants.create_tenant(f"b{stamp}").id)
    claim = repo.claims.open_claim("n1", 10, 30)
    jobs = Counter(c.job_id for c in claim.items)
    repo.claims.drop_claim(claim)
    assert jobs == {a.id: 5, b.id: 5}


def test_concurrent_open_claims_never_share_an_item(repo: Repository) -> None:
    job = _job(repo, 2000)
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer(node: str) -> None:
        fence = 0
        try:
            while True:
                claim = repo.claims.open_claim(node, 37, 30)
                if not claim.items:
                    return
                with lock:
                    seen.extend(c.id for c in claim.items)
                starts = []
                for c in claim.items:
                    fence += 1
                    starts.append(_start(c, fence))
                # Every third item is left (the slack is "full"): claimed again later.
                kept = starts[::3]
                left = {s.item_id for s in starts} - {s.item_id for s in kept}
                assert sorted(repo.claims.start_claim(claim, kept)) == sorted(
                    s.item_id for s in kept
                )
                with lock:
                    for item_id in left:
                        seen.remove(item_id)
                finishes = [
                    Finish(s.item_id, s.attempt, s.fencing_token, ItemState.SUCCEEDED,
                           result="{}", output_tokens=1)
                    for s in kept
                ]  # fmt: skip
                assert sorted(repo.items.finish(finishes)) == sorted(s.item_id for s in kept)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(f"n{k}",)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [i for i, n in Counter(seen).items() if n > 1] == []
    assert len(seen) == 2000
    assert repo.stats.counted_states(job.id) == {ItemState.SUCCEEDED: 2000}
    _assert_counters_match(repo, job.id)


def test_a_claim_and_its_start_take_three_round_trips(database_url: str) -> None:
    """BEGIN, the settings and the fair share read leave together; the pick alone (it arms the
    idle bound); the start with its COMMIT: three waits on the server, not six. A dropped
    claim keeps the connection's prepared statements: the next claim parses nothing again."""
    repo = Repository.connect(database_url, pool_size=1)
    try:
        _job(repo, 20)
        warm = repo.claims.open_claim("n1", 4, 30)
        repo.claims.start_claim(warm, [_start(c, k) for k, c in enumerate(warm.items, 1)])
        repo.claims.drop_claim(repo.claims.open_claim("n1", 4, 30))
        fairy = repo.engine.raw_connection()
        conn = fairy.driver_connection
        fairy.close()
        assert isinstance(conn, psycopg.Connection)
        with tempfile.TemporaryFile("w+") as trace:
            conn.pgconn.trace(trace.fileno())
            try:
                claim = repo.claims.open_claim("n1", 4, 30)
                started = repo.claims.start_claim(
                    claim, [_start(c, k) for k, c in enumerate(claim.items, 10)]
                )
            finally:
                conn.pgconn.untrace()
            trace.seek(0)
            # (direction, message, its first field) of each protocol message
            messages = [
                (f[1], f[3], f[4].strip()[:24] if len(f) > 4 else "")
                for f in (line.split("\t") for line in trace.read().splitlines())
            ]
    finally:
        repo.close()
    assert len(started) == 4
    assert sorted(started) == sorted(c.id for c in claim.items)
    waits = [m for m in messages if m[1] in ("ReadyForQuery", "Parse", "Sync", "Flush")]
    assert len([m for m in messages if m[1] == "ReadyForQuery"]) == 3, waits
    assert not [m for m in messages if m[1] == "Parse" and m[2].startswith('"_pg3')], waits
