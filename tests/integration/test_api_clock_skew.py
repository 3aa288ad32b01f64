"""An API or maintenance process whose clock is off by a minute judges Postgres' timestamps on
Postgres' clock (``Repository.now``): a batch's deadline is its window from the database's
now, a create is recovered from ``validating`` only once it is really stale, and a batch's
ETA counts the time it has really run.

Before, each took ``datetime.now()`` of its own host: every deadline moved by the skew, a
maintenance tick a minute ahead recovered creates a minute early, and the ETA was off by
twice the skew. The host's clock is skewed by patching what these modules read it through.

Real Postgres and Redis.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, tzinfo

import httpx
import pytest
from batch_api_support import api_settings, chat_file, make_tenant, serve
from sqlalchemy import create_engine, text

import backfill.batches
import backfill.finalize
import queue_api.routes.batches
from backfill.config import Settings
from backfill.finalize import recover_stale_validating
from backfill.states import ItemState, JobState
from backfill.store import Finish, NewItem, Repository, Start

SKEWS = [pytest.param(60.0, id="ahead-60s"), pytest.param(-60.0, id="behind-60s")]
HostSkew = Callable[[float], Callable[[], float]]


class _SkewedDatetime(datetime):
    skew_s = 0.0

    @classmethod
    def now(cls, tz: tzinfo | None = None) -> _SkewedDatetime:
        real = datetime.now(tz) + timedelta(seconds=cls.skew_s)
        return cls.fromtimestamp(real.timestamp(), tz)


@pytest.fixture
def host_skew(monkeypatch: pytest.MonkeyPatch) -> HostSkew:
    """Skews this process's clock for the API-side modules; returns the skewed host clock."""

    def apply(skew_s: float) -> Callable[[], float]:
        skewed = type("SkewedDatetime", (_SkewedDatetime,), {"skew_s": skew_s})
        for module in (backfill.batches, backfill.finalize, queue_api.routes.batches):
            monkeypatch.setattr(module, "datetime", skewed, raising=False)
        return lambda: time.time() + skew_s

    return apply


@pytest.fixture
def skewed_repo(database_url: str) -> Iterator[Callable[[Callable[[], float]], Repository]]:
    made: list[Repository] = []

    def make(host_clock: Callable[[], float]) -> Repository:
        repo = Repository(create_engine(database_url, pool_size=4), host_clock=host_clock)
        made.append(repo)
        return repo

    yield make
    for repo in made:
        repo.close()


def _db_now(repo: Repository) -> datetime:
    with repo.engine.connect() as conn:
        value: datetime = conn.execute(text("SELECT now()")).scalar_one()
    return value


@pytest.mark.parametrize("skew_s", SKEWS)
def test_a_batchs_deadline_is_its_window_from_the_databases_now(
    settings: Settings,
    host_skew: HostSkew,
    skewed_repo: Callable[[Callable[[], float]], Repository],
    skew_s: float,
) -> None:
    repo = skewed_repo(host_skew(skew_s))
    tenant = repo.tenants.create_tenant(f"acme-{secrets.token_hex(3)}")
    upload = backfill.batches.upload_file(
        repo, settings, tenant.id, filename="in.jsonl", purpose="batch", content=chat_file(2)
    )
    request = backfill.batches.BatchRequest(upload.id, "/v1/chat/completions", "1h")
    job = backfill.batches.create_batch(repo, settings, tenant, request)
    window = (job.deadline - job.created_at).total_seconds()
    assert abs(window - 3600) < 5, window


@pytest.mark.parametrize("skew_s", SKEWS)
def test_a_create_is_recovered_from_validating_only_once_stale_on_the_databases_clock(
    host_skew: HostSkew,
    skewed_repo: Callable[[Callable[[], float]], Repository],
    skew_s: float,
) -> None:
    """With a 60 s threshold: a create 30 s old is left alone, one 90 s old is recovered."""
    repo = skewed_repo(host_skew(skew_s))
    tenant = repo.tenants.create_tenant("acme")
    deadline = datetime.now(UTC) + timedelta(hours=1)
    young = repo.jobs.create_job(tenant.id, "file-x", "/v1/chat/completions", "1h", deadline)
    old = repo.jobs.create_job(tenant.id, "file-y", "/v1/chat/completions", "1h", deadline)
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE jobs SET created_at = now() - make_interval(secs => "
                "CASE WHEN id = :old THEN 90 ELSE 30 END) WHERE id IN (:old, :young)"
            ),
            {"old": old.id, "young": young.id},
        )
    assert recover_stale_validating(repo, older_than_s=60) == {old.id: JobState.FAILED}
    assert repo.jobs.get_job(None, young.id).state is JobState.VALIDATING


@pytest.mark.parametrize("skew_s", SKEWS)
def test_a_batchs_eta_counts_the_time_it_has_really_run(
    settings: Settings, host_skew: HostSkew, skew_s: float
) -> None:
    """In progress for 100 s with half its items done: it should be done in about 100 s."""
    s = api_settings(settings)
    repo = Repository.connect(s.database_url, pool_size=2)
    try:
        tenant = make_tenant(repo, "acme")
        job = repo.jobs.create_job(
            tenant.id, "file-x", "/v1/completions", "24h", datetime.now(UTC) + timedelta(hours=2)
        )
        repo.ingest.insert_items(job.id, [NewItem(i, f"r{i}", "{}", 5) for i in range(2)])
        repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        opened = repo.claims.open_claim("n1", 1, 30)
        [item] = opened.items
        assert repo.claims.start_claim(opened, [Start(item.id, item.attempt, "l1", 1, 16, 5)]) == [
            item.id
        ]
        assert repo.items.finish([Finish(item.id, item.attempt, 1, ItemState.SUCCEEDED, "{}")])
        with repo.engine.begin() as conn:
            conn.execute(
                text("UPDATE jobs SET in_progress_at = now() - interval '100 s' WHERE id = :j"),
                {"j": job.id},
            )
        host_skew(skew_s)
        with serve(s) as api:
            reply = httpx.get(
                f"{api.base_url}/v1/batches/{job.id}",
                headers={"Authorization": f"Bearer {tenant.key}"},
                timeout=30,
            )
        assert reply.status_code == 200, reply.text
        extras = reply.json()["backfill"]
        assert extras["eta_basis"] == "observed"
        due_in = extras["eta"] - _db_now(repo).timestamp()
        assert 80 <= due_in <= 120, due_in
    finally:
        repo.close()
