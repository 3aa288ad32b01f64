"""The ``backfill`` command as an operator runs it: a subprocess, its output and exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from openai import OpenAI
from sqlalchemy import text

from backfill.store import Repository, key_id
from devkit.harness import free_port

BACKFILL = str(Path(sys.executable).parent / "backfill")


def run(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "BACKFILL_DATABASE_URL": database_url}
    return subprocess.run(
        [BACKFILL, *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def wait_healthy(base: str) -> None:
    # Importing the API alone took 5 s on this machine at a load average of 11.
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "backfill api did not come up"
        time.sleep(0.1)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_migrate_brings_an_empty_database_to_the_schema(empty_database_url: str) -> None:
    result = run(empty_database_url, "migrate")
    assert result.returncode == 0, result.stderr
    repository = Repository.connect(empty_database_url)
    try:
        assert repository.nodes.nodes() == []
    finally:
        repository.close()


def test_tenants_create_prints_a_working_key_on_its_last_line(
    database_url: str, repo: Repository
) -> None:
    result = run(database_url, "tenants", "create", "acme", "--quota", "5000")
    assert result.returncode == 0, result.stderr
    key = result.stdout.strip().splitlines()[-1]
    tenant = repo.tenants.tenant_for_key(key)
    assert tenant is not None
    assert (tenant.name, tenant.enqueued_token_quota) == ("acme", 5000)

    assert "already exists" in one_line_error(run(database_url, "tenants", "create", "acme"))

    revoked = run(database_url, "tenants", "revoke-key", key)
    assert revoked.returncode == 0, revoked.stderr
    assert repo.tenants.tenant_for_key(key) is None
    assert "no live API key" in one_line_error(run(database_url, "tenants", "revoke-key", key))


def test_tenants_have_a_weight_set_at_create_or_later(database_url: str, repo: Repository) -> None:
    created = run(database_url, "tenants", "create", "acme", "--weight", "2.5")
    assert created.returncode == 0, created.stderr
    assert "weight 2.5" in created.stdout
    assert repo.tenants.tenant_by_name("acme").weight == 2.5
    assert run(database_url, "tenants", "create", "plain").returncode == 0
    assert repo.tenants.tenant_by_name("plain").weight == 1

    changed = run(database_url, "tenants", "set-weight", "plain", "3")
    assert changed.returncode == 0, changed.stderr
    assert repo.tenants.tenant_by_name("plain").weight == 3
    assert "no tenant named" in one_line_error(
        run(database_url, "tenants", "set-weight", "nobody", "3")
    )
    refused = "is not a positive number"
    assert refused in one_line_error(run(database_url, "tenants", "set-weight", "plain", "0"))
    assert refused in one_line_error(run(database_url, "tenants", "create", "z", "--weight", "-1"))
    assert repo.tenants.tenant_by_name("plain").weight == 3


def test_keys_are_listed_and_revoked_by_the_id_shown_at_creation(
    database_url: str, repo: Repository
) -> None:
    created = run(database_url, "tenants", "create", "acme")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    shown = key_id(key)
    assert f"key id {shown}" in created.stdout
    listed = run(database_url, "tenants", "keys", "acme")
    assert listed.returncode == 0, listed.stderr
    assert shown in listed.stdout
    assert "live" in listed.stdout
    assert key not in listed.stdout  # only the id is kept

    # Two live keys that share an id (a collision of 48 random bits, made here by hand):
    # the id is refused as ambiguous, and the whole key still works.
    tenant = repo.tenants.tenant_by_name("acme")
    with repo.engine.begin() as conn:
        conn.execute(
            text("INSERT INTO api_keys (tenant_id, digest, prefix) VALUES (:t, :d, :p)"),
            {"t": tenant.id, "d": "0" * 64, "p": shown},
        )
    assert "revoke by the whole key" in one_line_error(
        run(database_url, "tenants", "revoke-key", shown)
    )
    revoked = run(database_url, "tenants", "revoke-key", key)
    assert revoked.returncode == 0, revoked.stderr
    assert repo.tenants.tenant_for_key(key) is None
    assert "revoked" in run(database_url, "tenants", "keys", "acme").stdout


def test_an_unreachable_database_is_one_line_not_a_traceback() -> None:
    result = run("postgresql://postgres@127.0.0.1:1/nowhere", "tenants", "create", "x")
    assert "unavailable" in one_line_error(result)


def test_bad_settings_are_one_line_naming_the_problem(database_url: str) -> None:
    env_url = "mysql://root@localhost/db"
    assert "PostgreSQL" in one_line_error(run(env_url, "migrate"))


def test_api_serves_the_batch_api(
    database_url: str, redis_namespace: str, repo: Repository
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    key = repo.tenants.create_api_key(tenant.id)
    port = free_port()
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": database_url,
        "BACKFILL_REDIS_NAMESPACE": redis_namespace,
    }
    process = subprocess.Popen(
        [BACKFILL, "api", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base)
        client = OpenAI(api_key=key, base_url=f"{base}/v1", max_retries=0)
        assert client.batches.list().data == []
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_api_logs_one_json_object_a_line_when_told(
    database_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    port = free_port()
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": database_url,
        "BACKFILL_REDIS_NAMESPACE": redis_namespace,
        "BACKFILL_LOG_FORMAT": "json",
        "BACKFILL_LOG_LEVEL": "info",
    }
    err = tmp_path / "api.err"
    with err.open("wb") as sink:
        process = subprocess.Popen(
            [BACKFILL, "api", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=sink,
        )
        try:
            wait_healthy(f"http://127.0.0.1:{port}")
        finally:
            process.terminate()
            process.wait(timeout=15)
    lines = [line for line in err.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert any(r["logger"].startswith("uvicorn") for r in records), lines
    assert any(r["logger"] == "uvicorn.access" and "/healthz" in r["message"] for r in records)
    assert all({"ts", "level", "logger", "message"} <= set(r) for r in records)
