"""A batch's create and its cancel (or recovery) racing on real Postgres.

The create is held inside ``insert_items`` by a hook on the item stream, with part of the file
already written to the COPY, while the cancel (or the recovery of stale ``validating`` jobs)
runs in full; then the create goes on. No timing luck: the hook decides the interleaving.
Afterwards no item of the job may be claimable, and every counter must agree with the items.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from batch_api_support import chat_file, run_worker
from sqlalchemy import Engine, text

from backfill import batches
from backfill.config import Settings
from backfill.finalize import cancel_job, recover_stale_validating
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy, tick
from backfill.states import ITEM_CLAIMABLE, ItemState, JobState
from backfill.store import Database, JobRecord, NewItem, Repository, TenantRecord
from backfill.store.ingest import Ingest
from tests.integration.claiming import claim

LINES = 20_000
PAUSE_AFTER = 5_000
# Generous bounds that only turn a hang into a failure; nothing here waits for time to pass.
HANG_S = 120


class PausingIngest(Ingest):
    """The ingest role, whose ``insert_items`` stops after ``PAUSE_AFTER`` items have gone
    into the COPY and waits for ``go_on``: the create is inside its transaction meanwhile."""

    def __init__(self, db: Database, inside: threading.Event, go_on: threading.Event) -> None:
        super().__init__(db)
        self.inside = inside
        self.go_on = go_on

    def insert_items(self, job_id: str, items: Iterable[NewItem], **kwargs: Any) -> int:
        def paused() -> Iterator[NewItem]:
            for n, item in enumerate(items):
                if n == PAUSE_AFTER:
                    self.inside.set()
                    if not self.go_on.wait(HANG_S):
                        raise RuntimeError("the test never let the create go on")
                yield item

        return super().insert_items(job_id, paused(), **kwargs)


class PausingRepository(Repository):
    """A repository whose ingest role pauses inside a create's COPY (:class:`PausingIngest`)."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.inside = threading.Event()
        self.go_on = threading.Event()
        self.ingest = PausingIngest(self.db, self.inside, self.go_on)


@pytest.fixture
def pausing(database_url: str) -> Iterator[PausingRepository]:
    repository = PausingRepository(Repository.connect(database_url).engine)
    yield repository
    repository.go_on.set()
    repository.close()


class Create(threading.Thread):
    """``create_batch`` in a thread of its own; its answer (or error) kept for the test."""

    def __init__(self, repo: Repository, settings: Settings, tenant: TenantRecord, lines: int):
        super().__init__(daemon=True)
        # The create checks and stores the file itself, in its request, whatever its size.
        settings = settings.model_copy(update={"ingest_inline_bytes": 1 << 30})
        self.repo, self.settings, self.tenant = repo, settings, tenant
        content = chat_file(lines)
        upload = batches.upload_file(
            repo, settings, tenant.id, filename="in.jsonl", purpose="batch", content=content
        )
        self.request = batches.BatchRequest(upload.id, "/v1/chat/completions", "24h")
        self.job: JobRecord | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.job = batches.create_batch(self.repo, self.settings, self.tenant, self.request)
        except BaseException as exc:  # handed to the test thread
            self.error = exc

    def finished(self) -> JobRecord:
        self.join(HANG_S)
        assert not self.is_alive(), "the create did not finish"
        if self.error is not None:
            raise self.error
        assert self.job is not None
        return self.job


def _in_thread(call: Callable[[], object]) -> object:
    """Run ``call`` in another thread and return its answer; fails if it never returns."""
    out: list[object] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(HANG_S)
    assert out, "the call did not return while the create was inside insert_items"
    return out[0]


def _assert_consistent(repo: Repository, tenant: TenantRecord, job_id: str) -> None:
    truth = repo.stats.counted_states(job_id)
    counts = repo.jobs.get_job(None, job_id).counts
    for state in ItemState:
        assert counts.count(state) == truth.get(state, 0), state
    assert counts.total == sum(truth.values())
    assert not {s for s in truth if s in ITEM_CLAIMABLE}, truth
    assert claim(repo, "node-test", LINES) == []
    assert repo.jobs.count_active_jobs(tenant.id) == 0
    assert repo.jobs.enqueued_tokens(tenant.id) == 0
    assert repo.stats.backlog_tokens() == 0


def test_a_cancel_while_the_items_are_being_stored_leaves_no_claimable_item(
    repo: Repository, pausing: PausingRepository, settings: Settings
) -> None:
    tenant = repo.tenants.create_tenant(f"acme-{secrets.token_hex(3)}")
    create = Create(pausing, settings, tenant, LINES)
    create.start()
    assert pausing.inside.wait(HANG_S), "the create never reached insert_items"
    [job] = repo.jobs.list_jobs(tenant.id)
    assert job.state is JobState.VALIDATING

    cancelled = _in_thread(lambda: cancel_job(repo, tenant.id, job.id))
    assert isinstance(cancelled, JobRecord)
    assert cancelled.state in (JobState.CANCELLING, JobState.CANCELLED)
    pausing.go_on.set()
    answered = create.finished()

    assert answered.id == job.id
    assert answered.state is JobState.CANCELLED
    assert repo.jobs.get_job(None, job.id).state is JobState.CANCELLED
    _assert_consistent(repo, tenant, job.id)


def test_a_cancel_after_the_items_are_stored_cancels_every_one(
    repo: Repository, settings: Settings
) -> None:
    tenant = repo.tenants.create_tenant(f"acme-{secrets.token_hex(3)}")
    create = Create(repo, settings, tenant, 2_000)
    create.start()
    job = create.finished()
    assert job.state is JobState.IN_PROGRESS
    run_worker(repo, limit=5, leave_running=2)

    cancel_job(repo, tenant.id, job.id)
    truth = repo.stats.counted_states(job.id)
    assert truth.get(ItemState.CANCELLED) == 2_000 - 5
    assert not {s for s in truth if s in ITEM_CLAIMABLE}, truth
    assert claim(repo, "node-test", 2_000) == []


def test_recovery_leaves_a_live_create_alone_and_the_create_completes(
    repo: Repository, pausing: PausingRepository, settings: Settings
) -> None:
    tenant = repo.tenants.create_tenant(f"acme-{secrets.token_hex(3)}")
    create = Create(pausing, settings, tenant, LINES)
    create.start()
    assert pausing.inside.wait(HANG_S), "the create never reached insert_items"
    [job] = repo.jobs.list_jobs(tenant.id)

    later = datetime.now(UTC) + timedelta(hours=1)
    assert _in_thread(lambda: recover_stale_validating(repo, older_than_s=60, now=later)) == {}
    pausing.go_on.set()
    answered = create.finished()

    assert answered.state is JobState.IN_PROGRESS
    assert repo.stats.counted_states(job.id) == {ItemState.QUEUED: LINES}
    assert answered.counts.count(ItemState.QUEUED) == LINES


def test_items_of_a_job_that_is_not_in_progress_are_never_claimed(repo: Repository) -> None:
    tenant = repo.tenants.create_tenant(f"acme-{secrets.token_hex(3)}")
    job = repo.jobs.create_job(
        tenant.id, "file-x", "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(job.id, [NewItem(i, f"c{i}", "{}", 5) for i in range(3)])
    assert claim(repo, "node-test", 10) == []  # still validating
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    repo.jobs.move_job(job.id, JobState.CANCELLING)
    assert claim(repo, "node-test", 10) == []  # cancelling
    other = repo.jobs.create_job(
        tenant.id, "file-y", "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(other.id, [NewItem(0, "c0", "{}", 5)])
    repo.jobs.move_job(other.id, JobState.IN_PROGRESS)
    assert [c.job_id for c in claim(repo, "node-test", 10)] == [other.id]


def test_the_maintenance_tick_recovers_a_create_that_died_in_validating(
    repo: Repository, settings: Settings
) -> None:
    tenant = repo.tenants.create_tenant(f"acme-{secrets.token_hex(3)}")
    dead = repo.jobs.create_job(
        tenant.id, "file-x", "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    fresh = repo.jobs.create_job(
        tenant.id, "file-y", "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET created_at = now() - interval '1 day' WHERE id = :i"),
            {"i": dead.id},
        )
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace, pool_policy(settings))
    try:
        report = tick(repo, ledger, settings)
    finally:
        ledger.close()
    assert report.recovered == {dead.id: JobState.FAILED}
    assert repo.jobs.get_job(None, dead.id).state is JobState.FAILED
    assert repo.jobs.get_job(None, fresh.id).state is JobState.VALIDATING
