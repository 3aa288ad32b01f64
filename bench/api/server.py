"""A Backfill API of a benchmark's own: started as a process on a local port over the
benchmark's database and Redis namespace, with rate limits no benchmark reaches, and stopped
with that namespace's keys removed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import redis

from backfill.store import Repository

BACKFILL = (str(Path(sys.executable).parent / "backfill"),)
"""The ``backfill`` command of this interpreter's environment."""
PYTHON_CLI = (sys.executable, "-m", "backfill_cli")
"""The same command run as a module of this interpreter."""


def start_api(
    url: str,
    namespace: str,
    port: int,
    settings: Mapping[str, str] | None = None,
    command: Sequence[str] = BACKFILL,
) -> subprocess.Popen[bytes]:
    """``command api`` on 127.0.0.1:``port`` over the database at ``url`` and the Redis
    namespace ``namespace``, with tenant rate limits of 100,000/s and ``settings`` (more
    ``BACKFILL_*`` variables) on top; returned once it answers /healthz and its ingest
    process is ready (60 s at most)."""
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": url,
        "BACKFILL_REDIS_NAMESPACE": namespace,
        "BACKFILL_RATE_LIMIT_PER_S": "100000",
        "BACKFILL_RATE_LIMIT_BURST": "100000",
        **(settings or {}),
    }
    process = subprocess.Popen(
        [*command, "api", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            # Up, and its ingest process ready for the first large create.
            if answer.status_code == 200 and answer.json().get("ingest_ready", True):
                return process
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise RuntimeError("backfill api did not start")
        time.sleep(0.2)


def stop_api(process: subprocess.Popen[bytes], namespace: str) -> None:
    """Stop the API ``start_api`` started and remove its namespace's keys from Redis."""
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        # A loaded machine can keep it draining past that; what it held is the bench's own.
        process.kill()
        process.wait(timeout=15)
    client = redis.Redis()
    keys = list(client.scan_iter(match=f"{namespace}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def api_client(port: int, key: str, timeout: float) -> httpx.Client:
    """A client of the API ``start_api`` started on ``port``, with the tenant's ``key``."""
    return httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )


def bench_key(url: str) -> str:
    """The API key of a new tenant ``bench`` in the database at ``url``."""
    repo = Repository.connect(url)
    key = repo.tenants.create_api_key(repo.tenants.create_tenant("bench").id)
    repo.close()
    return key
