"""An ingest process reads the next deferred create's file while the one before it is stored
(issue 35): checking every line before the COPY costs a queue of good files no throughput.

What must hold, on real Postgres, with the ingest loop itself (``ingester.run``): the second
file is read while the first's COPY has not begun (that COPY is held until the second's last
line is read, so the overlap is seen as an event, not as a time); the tenant's storage cap
and quota are judged on what the first stored, so two files read side by side cannot pass
either together; a cancel of the second while the first is stored leaves it without a row;
every item of each accepted file is stored once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from batch_api_support import chat_file

from backfill import batches, ingester
from backfill.config import Settings
from backfill.finalize import cancel_job
from backfill.states import ItemState, JobState
from backfill.store import JobRecord, NewItem, Repository, TenantRecord
from tests.integration.test_deferred_ingest import _create as create_deferred

CHAT = "/v1/chat/completions"
LINES = 2_000
# Bounds that only turn a hang (or the old serial loop) into a failure.
HANG_S = 60


@pytest.fixture
def deferring(settings: Settings) -> Settings:
    """Every create of more than 1 KiB is deferred to an ingest process's main loop (none is
    small enough for its express lane)."""
    return settings.model_copy(update={"ingest_inline_bytes": 1024, "ingest_express_bytes": 1024})


def _create(
    repo: Repository, settings: Settings, tenant: TenantRecord, content: bytes
) -> JobRecord:
    job = create_deferred(repo, settings, tenant, content)
    assert job.state is JobState.VALIDATING
    return job


class HeldCopy:
    """``repo.ingest.insert_items`` watched: the first job's COPY waits (once its lines are read and
    judged) until every line of the second job's file has been read, and ``meanwhile`` runs
    then."""

    def __init__(
        self,
        repo: Repository,
        first: str,
        second: str,
        meanwhile: Callable[[], None] = lambda: None,
    ) -> None:
        self._insert = repo.ingest.insert_items
        self._first = first
        self._second = second
        self._meanwhile = meanwhile
        self.second_read = threading.Event()
        self.second_read_before_first_copy: bool | None = None

    def insert_items(self, job_id: str, items: Iterable[NewItem], **kw: Any) -> int:
        return self._insert(job_id, self._watched(job_id, items), **kw)

    def _watched(self, job_id: str, items: Iterable[NewItem]) -> Iterator[NewItem]:
        for n, item in enumerate(items):
            yield item
            if job_id == self._second and n == LINES - 1:
                self.second_read.set()
        if job_id == self._first:
            # Every line of the first is read and judged: its COPY comes next.
            self.second_read_before_first_copy = self.second_read.wait(HANG_S)
            self._meanwhile()


def _run_until_ingested(repo: Repository, settings: Settings, *job_ids: str) -> list[JobRecord]:
    stop = threading.Event()
    loop = threading.Thread(
        target=ingester.run, args=(repo, settings, stop), kwargs={"idle_poll_s": 0.05}
    )
    loop.start()
    try:
        deadline = time.monotonic() + 3 * HANG_S
        while True:
            jobs = [repo.jobs.get_job(None, j) for j in job_ids]
            if all(job.state is not JobState.VALIDATING for job in jobs):
                return jobs
            assert time.monotonic() < deadline, [job.state for job in jobs]
            time.sleep(0.05)
    finally:
        stop.set()
        loop.join(HANG_S)
        assert not loop.is_alive()


def test_the_next_file_is_read_while_the_one_before_is_stored(
    deferring: Settings, repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    first = _create(repo, deferring, tenant, chat_file(LINES))
    second = _create(repo, deferring, tenant, chat_file(LINES))
    held = HeldCopy(repo, first.id, second.id)
    monkeypatch.setattr(repo.ingest, "insert_items", held.insert_items)
    jobs = _run_until_ingested(repo, deferring, first.id, second.id)
    # The serial loop read the second file only once the first's COPY had committed.
    assert held.second_read_before_first_copy is True
    for job in jobs:
        assert job.state is JobState.IN_PROGRESS, job.errors
        assert job.counts.total == LINES
        assert repo.stats.counted_states(job.id) == {ItemState.QUEUED: LINES}


@pytest.mark.parametrize("bound", ["storage cap", "quota"])
def test_two_files_read_side_by_side_cannot_pass_a_bound_together(
    deferring: Settings, repo: Repository, monkeypatch: pytest.MonkeyPatch, bound: str
) -> None:
    content = chat_file(LINES)
    if bound == "storage cap":
        settings = deferring.model_copy(update={"max_stored_items_per_tenant": LINES * 3 // 2})
        tenant = repo.tenants.create_tenant("acme")
        code = "storage_cap_reached"
    else:
        settings = deferring
        probe = repo.tenants.create_tenant("probe")
        upload = batches.upload_file(
            repo, settings, probe.id, filename="in.jsonl", purpose="batch", content=content
        )
        assert upload.tokens_bound is not None
        tenant = repo.tenants.create_tenant("acme", upload.tokens_bound * 3 // 2)
        code = "enqueued_token_quota_exceeded"
    # Each fits alone; the second is read while the first's items are not yet committed.
    first = _create(repo, settings, tenant, content)
    second = _create(repo, settings, tenant, content)
    held = HeldCopy(repo, first.id, second.id)
    monkeypatch.setattr(repo.ingest, "insert_items", held.insert_items)
    stored, refused = _run_until_ingested(repo, settings, first.id, second.id)
    assert held.second_read_before_first_copy is True
    assert stored.state is JobState.IN_PROGRESS, stored.errors
    assert repo.stats.counted_states(first.id) == {ItemState.QUEUED: LINES}
    assert refused.state is JobState.FAILED
    assert refused.errors is not None
    assert refused.errors[0]["code"] == code
    assert repo.stats.counted_states(second.id) == {}


def test_a_file_cancelled_while_the_one_before_is_stored_stores_nothing(
    deferring: Settings, repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    first = _create(repo, deferring, tenant, chat_file(LINES))
    second = _create(repo, deferring, tenant, chat_file(LINES))
    held = HeldCopy(
        repo, first.id, second.id, meanwhile=lambda: cancel_job(repo, tenant.id, second.id)
    )
    monkeypatch.setattr(repo.ingest, "insert_items", held.insert_items)
    stored, cancelled = _run_until_ingested(repo, deferring, first.id, second.id)
    assert held.second_read_before_first_copy is True
    assert stored.state is JobState.IN_PROGRESS, stored.errors
    assert repo.stats.counted_states(first.id) == {ItemState.QUEUED: LINES}
    assert cancelled.state in {JobState.CANCELLED, JobState.CANCELLING}
    assert repo.stats.counted_states(second.id) == {}


SMALL_BYTES = 64 * 1024
SMALL_LINES = 3


class HeldUntil:
    """``repo.ingest.insert_items`` watched: ``held``'s COPY waits (once its lines are read and
    judged) until ``until()`` (by default: every line of another job has been read, ``read``)
    or :data:`HANG_S`; ``met`` says which."""

    def __init__(
        self, repo: Repository, held: str, until: Callable[[], bool] | None = None
    ) -> None:
        self._insert = repo.ingest.insert_items
        self._held = held
        self.read = threading.Event()
        self._until = until or self.read.is_set
        self.met: bool | None = None

    def insert_items(self, job_id: str, items: Iterable[NewItem], **kw: Any) -> int:
        return self._insert(job_id, self._watched(job_id, items), **kw)

    def _watched(self, job_id: str, items: Iterable[NewItem]) -> Iterator[NewItem]:
        for n, item in enumerate(items, start=1):
            yield item
            if job_id != self._held and n == SMALL_LINES:
                self.read.set()
        if job_id == self._held:
            deadline = time.monotonic() + HANG_S
            while not (met := self._until()) and time.monotonic() < deadline:
                time.sleep(0.05)
            self.met = met


def _two_tenants_files(repo: Repository, settings: Settings) -> tuple[JobRecord, JobRecord]:
    large, small = chat_file(LINES), chat_file(SMALL_LINES)
    assert len(large) > SMALL_BYTES >= len(small)
    a = repo.tenants.create_tenant("a")
    return _create(repo, settings, a, large), _create(
        repo, settings, repo.tenants.create_tenant("b"), small
    )


def _lanes(settings: Settings, **update: object) -> Settings:
    """Every create deferred; files of at most :data:`SMALL_BYTES` the express lane's."""
    return settings.model_copy(
        update={"ingest_inline_bytes": 0, "ingest_express_bytes": SMALL_BYTES, **update}
    )


def test_a_small_create_is_stored_while_another_tenants_large_file_is_copied(
    settings: Settings, repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red before: one loop took B's small create as the second of its overlap, read it, and
    then waited for A's COPY to end; now the express lane stores it meanwhile, and the main
    loop leaves small files to it."""
    lanes = _lanes(settings)
    a_job, b_job = _two_tenants_files(repo, lanes)

    def b_stored() -> bool:
        return repo.jobs.get_job(None, b_job.id).state is JobState.IN_PROGRESS

    held = HeldUntil(repo, a_job.id, b_stored)
    monkeypatch.setattr(repo.ingest, "insert_items", held.insert_items)
    a_done, b_done = _run_until_ingested(repo, lanes, a_job.id, b_job.id)
    assert held.met is True, "B's small create waited for A's COPY"
    assert a_done.state is JobState.IN_PROGRESS, a_done.errors
    assert b_done.state is JobState.IN_PROGRESS, b_done.errors
    assert repo.stats.counted_states(a_job.id) == {ItemState.QUEUED: LINES}
    assert repo.stats.counted_states(b_job.id) == {ItemState.QUEUED: SMALL_LINES}


def test_a_tenants_small_and_large_files_cannot_pass_its_cap_together(
    settings: Settings, repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The two lanes judge one tenant's creates in turn: whichever is judged second is judged
    on what the first stored (without the turn, both read and judged side by side passed)."""
    lanes = _lanes(settings, max_stored_items_per_tenant=LINES + 1)
    tenant = repo.tenants.create_tenant("acme")
    large = _create(repo, lanes, tenant, chat_file(LINES))
    small = _create(repo, lanes, tenant, chat_file(SMALL_LINES))
    # The large one's COPY (if it is judged first) waits until the small one is read.
    held = HeldUntil(repo, large.id)
    monkeypatch.setattr(repo.ingest, "insert_items", held.insert_items)
    done = _run_until_ingested(repo, lanes, large.id, small.id)
    states = sorted(job.state.value for job in done)
    assert states == [JobState.FAILED.value, JobState.IN_PROGRESS.value], states
    (refused,) = [job for job in done if job.state is JobState.FAILED]
    assert refused.errors is not None
    assert refused.errors[0]["code"] == "storage_cap_reached"
    assert repo.tenants.stored_items(tenant.id) <= LINES + 1
