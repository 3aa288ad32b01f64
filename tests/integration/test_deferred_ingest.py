"""Large batch creates answer ``validating`` at once; an ingest process checks and stores the
file (issue 35): on real Postgres, the API's own ingest process and ``backfill ingest``.

What must hold: the create does no per-line work on a large file; the ingest stores every
line once or fails the batch naming each bad line; an ingest that dies half way is begun
again (nothing of it stored), and a file that takes ingests down each time fails its batch;
two ingests never take one job; tenants take turns in the queue; a cancel before the ingest
stores nothing; the quota is judged again as it stands when the ingest begins; and the
recovery of creates that died in their request leaves deferred ones to the ingest processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import httpx
import psycopg
import pytest
from batch_api_support import (
    api_settings,
    chat_file,
    chat_line,
    jsonl,
    make_tenant,
    serve,
    submit_file,
)
from sqlalchemy import text

from backfill import batches, ingester
from backfill.batch_ingest import MAX_INGEST_ATTEMPTS
from backfill.config import Settings, libpq_url
from backfill.finalize import cancel_job, recover_stale_validating
from backfill.ingest_slots import RETRY_AFTER_S, TooManyIngests
from backfill.states import ItemState, JobState
from backfill.store import JobRecord, Repository, TenantRecord
from devkit.harness import free_port, spawn, stop, wait_ready

CHAT = "/v1/chat/completions"
# Bounds that only turn a hang into a failure.
HANG_S = 120


@pytest.fixture
def deferring(settings: Settings) -> Settings:
    """Every create of more than 1 KiB is deferred to an ingest process."""
    return settings.model_copy(update={"ingest_inline_bytes": 1024})


def _create(
    repo: Repository, settings: Settings, tenant: TenantRecord, content: bytes
) -> JobRecord:
    upload = batches.upload_file(
        repo, settings, tenant.id, filename="in.jsonl", purpose="batch", content=content
    )
    return batches.create_batch(
        repo, settings, tenant, batches.BatchRequest(upload.id, CHAT, "24h")
    )


def _wait_until_not_validating(repo: Repository, job_id: str) -> JobRecord:
    deadline = time.monotonic() + HANG_S
    while True:
        job = repo.jobs.get_job(None, job_id)
        if job.state is not JobState.VALIDATING:
            return job
        assert time.monotonic() < deadline, f"{job_id} still validating after {HANG_S} s"
        time.sleep(0.1)


def _ingest_attempts(repo: Repository, job_id: str) -> int:
    with repo.engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT ingest_attempts FROM jobs WHERE id = :i"), {"i": job_id}
            ).scalar_one()
        )


def test_a_large_create_answers_validating_and_the_apis_ingest_process_stores_it(
    deferring: Settings, repo: Repository
) -> None:
    tenant = make_tenant(repo, "acme")
    with serve(api_settings(deferring)) as server:
        client = server.client(tenant.key)
        batch = submit_file(client, chat_file(3_000))
        # The create did no per-line work: nothing stored yet, the batch validating.
        assert batch.status == "validating"
        job = _wait_until_not_validating(repo, batch.id)
        assert job.state is JobState.IN_PROGRESS, job.errors
        assert job.counts.total == 3_000
        assert repo.stats.counted_states(batch.id) == {ItemState.QUEUED: 3_000}
        # Bad input is reported as at the create: every bad line named, nothing stored.
        bad = chat_file(2_000) + jsonl([chat_line("late", url="/v1/nowhere"), {"custom_id": "x"}])
        failed = submit_file(client, bad)
        assert failed.status == "validating"
        seen = client.batches.retrieve(_wait_until_not_validating(repo, failed.id).id)
        assert seen.status == "failed"
        assert seen.errors is not None
        assert seen.errors.data is not None
        assert [e.line for e in seen.errors.data] == [2_001, 2_002]
        assert repo.stats.counted_states(failed.id) == {}
        # A small file is still checked in the request.
        small = submit_file(client, chat_file(2))
        assert small.status == "in_progress"
        assert server.app is not None
        assert server.app.state.ingesters.running == 1


def test_at_the_defaults_a_small_create_answers_validating_and_is_stored_by_the_express_lane(
    settings: Settings, repo: Repository
) -> None:
    """Every create answers at once, as OpenAI's does (red before: a file of up to 1 MiB was
    checked and stored in its request, at the API's own CPU priority)."""
    product = settings.model_copy(
        update={
            "ingest_inline_bytes": Settings.model_fields["ingest_inline_bytes"].default,
            "ingest_express_bytes": Settings.model_fields["ingest_express_bytes"].default,
        }
    )
    tenant = make_tenant(repo, "acme")
    with serve(api_settings(product)) as server:
        batch = submit_file(server.client(tenant.key), chat_file(2))
        assert batch.status == "validating"
        job = _wait_until_not_validating(repo, batch.id)
    assert job.state is JobState.IN_PROGRESS, job.errors
    assert repo.stats.counted_states(batch.id) == {ItemState.QUEUED: 2}


def test_creates_waiting_for_an_ingest_are_on_metrics(
    deferring: Settings, repo: Repository
) -> None:
    tenant = make_tenant(repo, "acme")
    # No ingest process of the API's own: the create waits for a `backfill ingest`.
    with serve(api_settings(deferring, ingesters=0)) as server:
        batch = submit_file(server.client(tenant.key), chat_file(500))
        assert batch.status == "validating"
        scraped = httpx.get(f"{server.base_url}/metrics").text
        assert server.app is not None
        assert server.app.state.ingesters.running == 0
    assert "backfill_ingest_queue 1.0" in scraped.splitlines()
    assert repo.jobs.get_job(None, batch.id).state is JobState.VALIDATING


def test_an_ingest_that_dies_half_way_is_begun_again_and_stores_each_line_once(
    deferring: Settings, repo: Repository
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    job = _create(repo, deferring, tenant, chat_file(5_000))
    assert job.state is JobState.VALIDATING
    # A first ingest takes the job (its lock, its attempt), then its process dies: its
    # connection closes with the lock held.
    dying = psycopg.connect(libpq_url(deferring.database_url), autocommit=True)
    row = dying.execute(
        "SELECT pg_try_advisory_lock(hashtextextended('backfill.ingest:' || %s, 0))", (job.id,)
    ).fetchone()
    assert row == (True,)
    dying.execute("UPDATE jobs SET ingest_attempts = 1 WHERE id = %s", (job.id,))
    # While that ingest lives, another ingest does not take the job.
    assert ingester.ingest_next(repo, deferring) is None
    dying.close()
    # A real ingest process takes it again and stores every line once.
    env = dict(os.environ, BACKFILL_DATABASE_URL=deferring.database_url)
    process = subprocess.Popen([sys.executable, "-m", "backfill_cli", "ingest"], env=env)
    try:
        done = _wait_until_not_validating(repo, job.id)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=HANG_S)
    assert done.state is JobState.IN_PROGRESS, done.errors
    assert done.counts.total == 5_000
    assert repo.stats.counted_states(job.id) == {ItemState.QUEUED: 5_000}
    assert _ingest_attempts(repo, job.id) == 2
    assert process.returncode == 0


def test_a_file_that_takes_every_ingest_down_fails_its_batch(
    deferring: Settings, repo: Repository
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    job = _create(repo, deferring, tenant, chat_file(100))
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE jobs SET ingest_attempts = :n WHERE id = :i"),
            {"n": MAX_INGEST_ATTEMPTS, "i": job.id},
        )
    done = ingester.ingest_next(repo, deferring)
    assert done is not None
    assert done.state is JobState.FAILED
    failed = repo.jobs.get_job(None, job.id)
    assert failed.errors is not None
    assert failed.errors[0]["code"] == "validation_interrupted"
    assert repo.stats.counted_states(job.id) == {}


def test_tenants_take_turns_in_the_ingest_queue(deferring: Settings, repo: Repository) -> None:
    a = repo.tenants.create_tenant("a")
    b = repo.tenants.create_tenant("b")
    a_jobs = [_create(repo, deferring, a, chat_file(50)).id for _ in range(3)]
    b_job = _create(repo, deferring, b, chat_file(50)).id
    order = []
    while (done := ingester.ingest_next(repo, deferring)) is not None:
        assert done.state is JobState.IN_PROGRESS
        order.append(done.job_id)
    # B's one create, queued after A's three, is the second taken, not the fourth.
    assert order == [a_jobs[0], b_job, a_jobs[1], a_jobs[2]]


def test_a_cancel_before_the_ingest_stores_nothing(deferring: Settings, repo: Repository) -> None:
    tenant = repo.tenants.create_tenant("acme")
    job = _create(repo, deferring, tenant, chat_file(200))
    cancel_job(repo, tenant.id, job.id)
    assert ingester.ingest_next(repo, deferring) is None
    assert repo.jobs.get_job(None, job.id).state in {JobState.CANCELLED, JobState.CANCELLING}
    assert repo.stats.counted_states(job.id) == {}


def test_the_quota_is_judged_again_when_the_ingest_begins(
    deferring: Settings, repo: Repository
) -> None:
    # Each of two creates fits the quota alone; admitted together (neither stored yet),
    # the second ingest finds the first's items enqueued and refuses.
    content = chat_file(100)
    probe = repo.tenants.create_tenant("probe")
    upload = batches.upload_file(
        repo, deferring, probe.id, filename="in.jsonl", purpose="batch", content=content
    )
    assert upload.tokens_bound is not None
    tenant = repo.tenants.create_tenant("acme", upload.tokens_bound * 3 // 2)
    first = _create(repo, deferring, tenant, content)
    second = _create(repo, deferring, tenant, content)
    assert (first.state, second.state) == (JobState.VALIDATING, JobState.VALIDATING)
    assert ingester.ingest_next(repo, deferring) is not None
    assert ingester.ingest_next(repo, deferring) is not None
    assert repo.jobs.get_job(None, first.id).state is JobState.IN_PROGRESS
    refused = repo.jobs.get_job(None, second.id)
    assert refused.state is JobState.FAILED
    assert refused.errors is not None
    assert refused.errors[0]["code"] == "enqueued_token_quota_exceeded"
    assert repo.stats.counted_states(second.id) == {}


def test_the_recovery_of_dead_creates_leaves_deferred_ones_to_the_ingest(
    deferring: Settings, repo: Repository
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    job = _create(repo, deferring, tenant, chat_file(100))
    later = repo.now() + timedelta(hours=1)
    assert recover_stale_validating(repo, older_than_s=60, now=later) == {}
    done = ingester.ingest_next(repo, deferring)
    assert done is not None
    assert done.job_id == job.id
    assert done is not None
    assert done.state is JobState.IN_PROGRESS


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started, from any of its threads."""
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:\tZ") for line in f)
    except FileNotFoundError:
        return False


def test_an_api_process_killed_outright_leaves_no_ingest_process_behind(
    deferring: Settings, repo: Repository, tmp_path: Path
) -> None:
    key = repo.tenants.create_api_key(repo.tenants.create_tenant("acme").id)
    port = free_port()
    env = dict(
        os.environ,
        BACKFILL_DATABASE_URL=deferring.database_url,
        BACKFILL_REDIS_NAMESPACE=deferring.redis_namespace,
        BACKFILL_INGEST_INLINE_BYTES="1024",
    )
    api = spawn(
        [sys.executable, "-m", "backfill_cli", "api", "--port", str(port)],
        tmp_path / "api.log",
        env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(api, lambda: _answers(f"{base}/healthz"), HANG_S)
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as h:
            upload = h.post(
                "/v1/files", files={"file": ("in.jsonl", chat_file(100))}, data={"purpose": "batch"}
            ).raise_for_status()
            batch = h.post(
                "/v1/batches",
                json={
                    "input_file_id": upload.json()["id"],
                    "endpoint": CHAT,
                    "completion_window": "24h",
                },
            ).raise_for_status()
        assert batch.json()["status"] == "validating"
        assert _wait_until_not_validating(repo, batch.json()["id"]).state is JobState.IN_PROGRESS
        children = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in _children(api.pid)}
        ingests = [pid for pid, argv in children.items() if b"spawn_main" in argv]
        assert len(ingests) == 1, children
        ingest = ingests[0]
        api.kill()
        api.wait()
        deadline = time.monotonic() + HANG_S
        while _alive(ingest):
            assert time.monotonic() < deadline, "the ingest process outlived its API process"
            time.sleep(0.2)
    finally:
        stop(api, 5, group=True)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def test_a_tenants_deferred_creates_are_bounded_and_another_tenants_are_not(
    deferring: Settings, repo: Repository
) -> None:
    # A flood of large creates once queued without bound: each a full create for the API and
    # an ingest of the whole file for the shared ingest process.
    bounded = deferring.model_copy(update={"max_deferred_creates_per_tenant": 2})
    flooder, other = repo.tenants.create_tenant("flooder"), repo.tenants.create_tenant("other")
    first = [_create(repo, bounded, flooder, chat_file(50)) for _ in range(2)]
    assert all(job.state is JobState.VALIDATING for job in first)
    upload = batches.upload_file(
        repo, bounded, flooder.id, filename="in.jsonl", purpose="batch", content=chat_file(50)
    )
    request = batches.BatchRequest(upload.id, CHAT, "24h")
    with pytest.raises(TooManyIngests) as refused:
        batches.create_batch(repo, bounded, flooder, request)
    assert refused.value.retry_after_s == RETRY_AFTER_S
    assert "at most 2 at once" in refused.value.message
    # The bound is the tenant's own; and once an ingest is done the tenant may create again.
    assert _create(repo, bounded, other, chat_file(50)).state is JobState.VALIDATING
    assert ingester.ingest_next(repo, bounded) is not None
    assert batches.create_batch(repo, bounded, flooder, request).state is JobState.VALIDATING
