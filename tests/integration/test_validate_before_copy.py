"""A batch file that will be refused costs Postgres nothing (issue 35): every line is checked
before the first row of its items reaches Postgres, on real Postgres, deferred and inline.

How "nothing reached Postgres" is told, exactly and without waiting on lazily flushed
statistics: every row a COPY into ``items`` forms draws an id from the table's identity
sequence, and a sequence does not roll back; a rolled-back COPY also leaves the heap it
extended behind. So the sequence's last value and the heap's size, both unchanged, say no row
was formed (a refused file used to stream all its good lines into a COPY rolled back at the
bad last one).
"""

from __future__ import annotations

import tempfile
from typing import Any, NamedTuple

import pytest
from batch_api_support import chat_file, chat_line, jsonl

from backfill import batches, ingester
from backfill.config import Settings
from backfill.states import ItemState, JobState
from backfill.store import JobRecord, Repository, TenantRecord
from backfill.store import ingest as store_ingest
from tests.integration.support_sql import query_one

CHAT = "/v1/chat/completions"
LINES = 3_000


class ItemsFootprint(NamedTuple):
    last_id: int
    """The items id sequence's last value (0: never drawn)."""
    heap_bytes: int


def _footprint(repo: Repository) -> ItemsFootprint:
    row = query_one(
        repo,
        "SELECT coalesce(pg_sequence_last_value(pg_get_serial_sequence('items', 'id')), "
        "0), pg_relation_size('items')",
    )
    return ItemsFootprint(int(row[0]), int(row[1]))


def _bad_last_line() -> bytes:
    return chat_file(LINES - 1) + jsonl([chat_line("late", url="/v1/nowhere")])


def _create(
    repo: Repository, settings: Settings, tenant: TenantRecord, content: bytes
) -> JobRecord:
    upload = batches.upload_file(
        repo, settings, tenant.id, filename="in.jsonl", purpose="batch", content=content
    )
    return batches.create_batch(
        repo, settings, tenant, batches.BatchRequest(upload.id, CHAT, "24h")
    )


@pytest.fixture(params=["deferred", "inline"])
def ingest(request: pytest.FixtureRequest, settings: Settings) -> Settings:
    """A create whose file an ingest process checks, or the create's request itself."""
    inline_bytes = 1024 if request.param == "deferred" else 1 << 30
    return settings.model_copy(update={"ingest_inline_bytes": inline_bytes})


def _created(repo: Repository, settings: Settings, tenant: TenantRecord, content: bytes) -> str:
    job = _create(repo, settings, tenant, content)
    if job.state is JobState.VALIDATING:
        done = ingester.ingest_next(repo, settings)
        assert done is not None
        assert done.job_id == job.id
    return job.id


def test_a_file_whose_last_line_is_bad_forms_no_item_row(
    repo: Repository, ingest: Settings
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    before = _footprint(repo)

    job_id = _created(repo, ingest, tenant, _bad_last_line())

    job = repo.jobs.get_job(None, job_id)
    assert job.state is JobState.FAILED
    assert [e["line"] for e in job.errors or []] == [LINES]
    assert _footprint(repo) == before
    assert repo.stats.counted_states(job_id) == {}


def test_a_good_file_still_stores_every_item_once(repo: Repository, ingest: Settings) -> None:
    tenant = repo.tenants.create_tenant("acme")
    before = _footprint(repo)

    job_id = _created(repo, ingest, tenant, chat_file(LINES))

    job = repo.jobs.get_job(None, job_id)
    assert job.state is JobState.IN_PROGRESS, job.errors
    assert job.counts.total == LINES
    assert repo.stats.counted_states(job_id) == {ItemState.QUEUED: LINES}
    assert _footprint(repo).last_id == before.last_id + LINES


def test_a_file_larger_than_the_in_memory_spool_is_stored_from_disk(
    repo: Repository, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every spool rolls over to a temporary file at its first row.
    monkeypatch.setattr(store_ingest, "SPOOL_IN_MEMORY_BYTES", 1)
    rolled: list[bool] = []
    spooled = tempfile.SpooledTemporaryFile

    def watched(*args: Any, **kwargs: Any) -> Any:
        spool = spooled(*args, **kwargs)
        rolled_over = spool.rollover

        def rollover() -> None:
            rolled.append(True)
            rolled_over()

        spool.rollover = rollover  # type: ignore[method-assign]
        return spool

    monkeypatch.setattr(tempfile, "SpooledTemporaryFile", watched)
    tenant = repo.tenants.create_tenant("acme")
    inline = settings.model_copy(update={"ingest_inline_bytes": 1 << 30})

    job_id = _created(repo, inline, tenant, chat_file(LINES))

    assert rolled, "the spool never went to disk"
    assert repo.jobs.get_job(None, job_id).state is JobState.IN_PROGRESS
    assert repo.stats.counted_states(job_id) == {ItemState.QUEUED: LINES}
