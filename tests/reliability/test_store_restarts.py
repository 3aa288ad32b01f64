"""Scenarios 5 and 6: the stores die under a running job (each test kills its own instance,
never the machine's shared one).

5. Redis killed with SIGKILL and started again empty (no persistence) while items run: the
   ledger is rebuilt from Postgres by the maintenance tick, batch admission stays closed until
   then and resumes after, no sampled moment over-commits the pool, nothing is lost.
6. Postgres stopped with ``-m immediate`` (a crash: recovery from WAL on start) mid-job: the API
   answers 503 with Retry-After while it is down, workers retry, and the job completes with
   nothing lost or doubled.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backfill.config import Settings
from backfill.states import ItemState
from migrations.migrate import upgrade
from tests.integration.batch_api_support import api_settings, make_tenant, serve
from tests.reliability.conftest import (
    LEASE_TTL_S,
    REAPER_S,
    EngineHandle,
    fast_settings,
    make_deployment,
)
from tests.reliability.services import PostgresServer, RedisServer
from tests.reliability.support import maintenance, report, sampling
from tests.reliability.test_worker_kill import deployment_workers

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def own_redis(workdir: Path) -> Iterator[RedisServer]:
    server = RedisServer(workdir)
    server.start()
    yield server
    server.close()


@pytest.fixture
def own_postgres(workdir: Path) -> Iterator[PostgresServer]:
    # The cluster is owned by the postgres OS user when the tests run as root: it must be
    # able to reach its folder.
    workdir.chmod(0o755)
    (workdir / "pg").mkdir()
    server = PostgresServer(workdir / "pg")
    server.init()
    server.start()
    yield server
    server.close()


def test_redis_restart_rebuilds_the_ledger_and_the_job_completes(
    settings: Settings, engine: EngineHandle, own_redis: RedisServer, workdir: Path
) -> None:
    s = fast_settings(settings, redis_url=own_redis.url, redis_namespace="bfrel")
    d = make_deployment(s, engine.url)
    n = 400
    job = d.submit(n, max_tokens=24, tag="redis")
    workers = deployment_workers(d, workdir, 2)
    try:
        with maintenance(d, REAPER_S) as upkeep, sampling(d.ledger, d.node, s) as samples:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready()
            d.wait(lambda: d.counts(job).get(ItemState.RUNNING, 0) >= 10, 60, "items running")
            in_flight = d.counts(job).get(ItemState.RUNNING, 0)
            done_before = d.done(job)
            rebuilds = upkeep.rebuilds
            down_s = own_redis.restart()
            restarted = time.monotonic()
            rebuilt_s = d.wait(lambda: upkeep.rebuilds > rebuilds, 60, "the ledger rebuilt")
            done_at_rebuild = d.done(job)
            # Admission resumes: new items start after the rebuild.
            resumed_s = d.wait(
                lambda: d.done(job) > done_at_rebuild + 20, 120, "batch admission to resume"
            )
            d.wait(lambda: d.done(job) == n, 300, "every item")
            elapsed = time.monotonic() - restarted
            d.assert_no_leak(timeout=LEASE_TTL_S + 10)
            for w in workers:
                w.terminate()
    finally:
        for w in workers:
            w.close()
        d.ledger.close()
    once = d.assert_exactly_once(job, n)
    d.repo.close()
    report(
        "5 Redis kill -9 and restart (no persistence)",
        items=n,
        running_at_kill=in_flight,
        done_at_kill=done_before,
        redis_down_s=round(down_s, 2),
        rebuilt_after_s=round(rebuilt_s, 2),
        admission_resumed_after_s=round(rebuilt_s + resumed_s, 2),
        finished_after_restart_s=round(elapsed, 1),
        lost=once["lost"],
        doubled=once["doubled"],
        ledger_samples=samples.samples,
        peak_batch_tokens=samples.peak_batch,
        batch_limit=samples.batch_limit,
        overcommits=len(samples.violations),
    )
    assert not samples.violations, samples.violations[:5]
    assert samples.peak_batch <= samples.batch_limit


def test_postgres_restart_answers_503_then_the_job_completes(
    settings: Settings, engine: EngineHandle, own_postgres: PostgresServer, workdir: Path
) -> None:
    url = own_postgres.create_database(f"bf_rel_{secrets.token_hex(3)}")
    upgrade(url)
    s = fast_settings(settings, database_url=url)
    d = make_deployment(s, engine.url)
    n = 300
    job = d.submit(n, max_tokens=24, tag="pg")
    tenant = make_tenant(d.repo, "pg-restart")
    workers = deployment_workers(d, workdir, 2)
    answers: list[tuple[int, str | None]] = []
    try:
        with (
            serve(api_settings(s)) as api,
            httpx.Client(
                base_url=api.base_url,
                headers={"Authorization": f"Bearer {tenant.key}"},
                timeout=10,
            ) as http,
            maintenance(d, REAPER_S) as upkeep,
        ):
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready()
            d.wait(lambda: d.done(job) >= n // 4, 120, "a quarter of the items")
            done_before = d.done(job)
            own_postgres.stop("immediate")
            stopped = time.monotonic()
            for path in ("/v1/batches", "/v1/files", "/healthz"):
                r = http.get(path)
                answers.append((r.status_code, r.headers.get("retry-after")))
            upload = http.post(
                "/v1/files", files={"file": ("in.jsonl", b"{}\n")}, data={"purpose": "batch"}
            )
            answers.append((upload.status_code, upload.headers.get("retry-after")))
            time.sleep(3)
            own_postgres.start()
            down_s = time.monotonic() - stopped
            # The API serves again (its pooled connections died with the server).
            back = [http.get("/v1/batches").status_code for _ in range(3)]
            d.wait(lambda: d.done(job) == n, 300, "every item")
            elapsed = time.monotonic() - stopped
            d.assert_no_leak(timeout=LEASE_TTL_S + 10)
            for w in workers:
                w.terminate()
    finally:
        for w in workers:
            w.close()
        d.ledger.close()
    once = d.assert_exactly_once(job, n)
    d.repo.close()
    report(
        "6 Postgres crash (stop -m immediate) and restart",
        items=n,
        done_at_crash=done_before,
        postgres_down_s=round(down_s, 1),
        answers_while_down=[a[0] for a in answers],
        retry_after=sorted({a[1] for a in answers if a[1]}),
        answers_after=back,
        failed_ticks=upkeep.failed_ticks,
        finished_after_crash_s=round(elapsed, 1),
        lost=once["lost"],
        doubled=once["doubled"],
    )
    assert all(code == 503 and retry for code, retry in answers), answers
    assert back[-1] == 200, back
