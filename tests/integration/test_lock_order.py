"""Statements that lock many items of a job take them in id order, whatever order the rows lie
in on disk, so two of them can never wait on each other in a cycle (a deadlock, which
Postgres breaks after a second by aborting one: a cancel answering 503, a worker's commit
failing). The hot path's statements (commit, heartbeat, finish) are driven by id-sorted
arrays for the same reason.

How it is seen: a blocker holds the middle item; the statement under test, started beside it,
takes every item before it in its lock order and waits there. A third session's ``SKIP
LOCKED`` read then shows which items it took. The items' rows are first moved on disk in
reverse id order (each updated, newest id first), so an order that follows the disk, or an
index in disk order, shows as the wrong half.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

from backfill.config import libpq_url
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository

N = 40


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    r = Repository.connect(database_url, pool_size=4)
    yield r
    r.close()


def _job_in_reverse_disk_order(repo: Repository, url: str) -> tuple[str, str, list[int]]:
    tenant_id = repo.tenants.create_tenant(f"t{datetime.now(UTC).timestamp()}").id
    f = repo.files.create_file(tenant_id, "batch", "in.jsonl", b"{}")
    job = repo.jobs.create_job(
        tenant_id, f.id, "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(
        job.id, (NewItem(i, f"r{i}", '{"messages": []}', 16) for i in range(N))
    )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    with psycopg.connect(libpq_url(url), autocommit=True) as conn:
        ids = [
            r[0]
            for r in conn.execute("SELECT id FROM items WHERE job_id = %s ORDER BY id", (job.id,))
        ]
        # A state change is never a HOT update: each row gets a new place at the table's end.
        for item_id in reversed(ids):
            conn.execute("UPDATE items SET state = 'deferred' WHERE id = %s", (item_id,))
            conn.execute("UPDATE items SET state = 'queued' WHERE id = %s", (item_id,))
        conn.execute("ANALYZE items")
    return tenant_id, job.id, ids


def _taken_before_the_blocker(
    url: str, ids: list[int], statement: Callable[[], object]
) -> set[int]:
    """The items ``statement`` had locked when it reached the middle item, held elsewhere."""
    middle = ids[len(ids) // 2]
    blocker = psycopg.connect(libpq_url(url))
    blocker.execute("SELECT 1 FROM items WHERE id = %s FOR UPDATE", (middle,))
    errors: list[BaseException] = []

    def run() -> None:
        try:
            statement()
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=run)
    worker.start()
    try:
        with psycopg.connect(libpq_url(url), autocommit=True) as probe:
            for _ in range(200):
                waiting = probe.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock'"
                ).fetchone()
                if waiting and waiting[0] >= 1:
                    break
                threading.Event().wait(0.05)
            else:
                pytest.fail("the statement never waited for the blocked item")
            with probe.transaction():
                free = {
                    r[0]
                    for r in probe.execute(
                        "SELECT id FROM items WHERE id = ANY(%s) FOR UPDATE SKIP LOCKED", (ids,)
                    )
                }
    finally:
        blocker.rollback()
        blocker.close()
        worker.join(30)
    assert not errors, errors
    return set(ids) - free - {middle}


def test_ending_a_job_locks_its_items_in_id_order(repo: Repository, database_url: str) -> None:
    _, job_id, ids = _job_in_reverse_disk_order(repo, database_url)
    taken = _taken_before_the_blocker(
        database_url, ids, lambda: repo.items.end_items(job_id, ItemState.CANCELLED)
    )
    assert taken == set(ids[: len(ids) // 2])


def test_deleting_an_input_file_locks_its_items_in_id_order(
    repo: Repository, database_url: str
) -> None:
    tenant_id, job_id, ids = _job_in_reverse_disk_order(repo, database_url)
    file_id = repo.jobs.get_job(None, job_id).input_file_id
    with psycopg.connect(libpq_url(database_url), autocommit=True) as conn:
        # Items that point into the file (their own copy gone), as a create leaves them.
        conn.execute(
            "UPDATE items SET body = NULL, body_seq = 0, body_at = 0, body_len = 2 "
            "WHERE job_id = %s",
            (job_id,),
        )
    taken = _taken_before_the_blocker(
        database_url, ids, lambda: repo.files.delete_file(tenant_id, file_id)
    )
    assert taken == set(ids[: len(ids) // 2])
