"""A Backfill deployment beside one engine, for benchmarks: ``backfill api`` and
``backfill worker --beat`` as their own processes (as in production) over a scratch database
and a ledger namespace of their own, with settings overrides passed as ``BACKFILL_*``
environment variables, so one engine can be measured under several policies in one run.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
import redis
from prometheus_client.parser import text_string_to_metric_families

from backfill.config import get_settings, libpq_url
from backfill.store import Repository
from bench.common import scratch_database
from devkit import harness

BACKFILL = [sys.executable, "-m", "backfill_cli"]
BATCH_ENDED = {"completed", "failed", "expired", "cancelled"}


def settings_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """``{"max_in_flight_per_node": "8"}`` or ``{"BACKFILL_MAX_IN_FLIGHT_PER_NODE": "8"}`` as
    environment variables."""
    out = {}
    for key, value in overrides.items():
        name = key.upper()
        out[name if name.startswith("BACKFILL_") else f"BACKFILL_{name}"] = str(value)
    return out


def counters(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named Prometheus sample summed over its labels (missing ones read 0)."""
    wanted = set(names)
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] += sample.value
    return out


@dataclass
class BackfillStack:
    """API and worker processes for one engine; use :meth:`running`."""

    engine_url: str
    logs: Path
    overrides: Mapping[str, str] = field(default_factory=dict)
    node: str = field(default_factory=lambda: f"bench-{secrets.token_hex(3)}")
    port: int = 0
    key: str = ""
    pids: dict[str, int] = field(default_factory=dict)
    """The API's and the worker's process ids, once running (for CPU accounting)."""
    database_url: str = ""
    namespace: str = field(default_factory=lambda: f"bfprot{secrets.token_hex(3)}")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    @contextlib.contextmanager
    def running(self) -> Iterator[BackfillStack]:
        self.port = harness.free_port()
        self.logs.mkdir(parents=True, exist_ok=True)
        settings = get_settings()
        with ExitStack() as stack:
            self.database_url = stack.enter_context(scratch_database("bfprot"))
            stack.callback(self._forget_ledger, settings.redis_url)
            repo = Repository.connect(self.database_url, pool_size=1)
            try:
                self.key = repo.tenants.create_api_key(repo.tenants.create_tenant("bench").id)
            finally:
                repo.close()
            env = {
                **os.environ,
                "BACKFILL_DATABASE_URL": self.database_url,
                "BACKFILL_REDIS_URL": settings.redis_url,
                "BACKFILL_REDIS_NAMESPACE": self.namespace,
                "BACKFILL_RATE_LIMIT_PER_S": "100000",
                "BACKFILL_RATE_LIMIT_BURST": "100000",
                # One tenant stands for every interactive user of the deployment (and the
                # rate limit above for theirs): a tenant's share of a node is a bound between
                # tenants, and here it would queue the benchmark's own bursts in the gateway.
                "BACKFILL_GATEWAY_TENANT_SHARE": "1",
                # Cancelled batches are finalised on the maintenance tick; a short tick keeps
                # the engine's drain between scenarios short.
                "BACKFILL_REAPER_INTERVAL_S": "1",
                **settings_env(self.overrides),
            }
            api = self._spawn("api", ["api", "--port", str(self.port)], env, stack)
            worker = self._spawn(
                "worker",
                ["worker", "--node", self.node, "--engine-url", self.engine_url, "--beat"],
                env,
                stack,
            )
            self.pids = {"bf_api": api.pid, "bf_worker": worker.pid}
            self._wait_ready(api, worker)
            yield self

    def _spawn(
        self, name: str, args: list[str], env: dict[str, str], stack: ExitStack
    ) -> subprocess.Popen[bytes]:
        proc = harness.spawn(
            [*BACKFILL, *args],
            self.logs / f"{name}.log",
            env=env,
            log_mode="wb",
            own_session=False,
            death_signal=None,
        )
        stack.callback(harness.stop, proc, 45)
        return proc

    def _wait_ready(self, *procs: subprocess.Popen[bytes]) -> None:
        repo = Repository.connect(self.database_url, pool_size=1)

        def ready() -> bool:
            try:
                api_up = httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                api_up = False
            return api_up and any(n.name == self.node for n in repo.nodes.nodes())

        try:
            harness.wait_ready(procs, ready, 180)
        except harness.ExitedWhileStarting:
            raise RuntimeError(f"backfill api or worker exited; logs in {self.logs}") from None
        except harness.NotReady:
            raise RuntimeError(
                f"backfill api or worker not ready in 180 s; logs in {self.logs}"
            ) from None
        finally:
            repo.close()

    def _forget_ledger(self, redis_url: str) -> None:
        client = redis.Redis.from_url(redis_url)
        try:
            for k in client.scan_iter(match=f"{self.namespace}*", count=1000):
                client.delete(k)
        finally:
            client.close()

    # -----------------------------------------------------------------------------------------

    def submit(self, bodies: Sequence[dict[str, Any]]) -> str:
        """Upload ``bodies`` as a chat-completions batch and create it; returns its id."""
        data = "".join(
            json.dumps(
                {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": b}
            )
            + "\n"
            for i, b in enumerate(bodies)
        ).encode()
        with httpx.Client(base_url=self.base, headers=self.auth, timeout=120) as client:
            return upload_batch(client, data, "in.jsonl")

    def cancel(self, batch_id: str) -> None:
        with httpx.Client(base_url=self.base, headers=self.auth, timeout=60) as client:
            client.post(f"/v1/batches/{batch_id}/cancel").raise_for_status()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base}/metrics", timeout=30).text
        return counters(
            text,
            [
                "backfill_preemptions_total",
                "backfill_gateway_batch_preemptions_total",
                "backfill_gateway_rejections_total",
                "backfill_gateway_admission_wait_seconds_sum",
                "backfill_gateway_admission_wait_seconds_count",
            ],
        )

    def preempted_attempts(self) -> tuple[int, int]:
        """Batch attempts Backfill preempted so far, and the tokens their resumption prefills
        again (the item's prompt plus the output kept so far; a lower bound when an item was
        preempted more than once)."""
        with psycopg.connect(libpq_url(self.database_url)) as conn:
            row = conn.execute(
                "SELECT count(*), coalesce(sum(coalesce(i.prompt_tokens, 0) "
                "+ coalesce(a.output_tokens, 0)), 0) FROM attempts a "
                "JOIN items i ON i.id = a.item_id WHERE a.outcome = 'preempted'"
            ).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)


def upload_batch(client: httpx.Client, content: bytes, name: str) -> str:
    """Upload ``content`` as the batch input file ``name`` and create a chat-completions batch
    of it (24 h window) through ``client``; returns the batch's id."""
    return create_batch(client, upload_input(client, content, name))


def upload_input(client: httpx.Client, content: bytes, name: str) -> str:
    """Upload ``content`` as the batch input file ``name``; returns the file's id."""
    uploaded = client.post("/v1/files", files={"file": (name, content)}, data={"purpose": "batch"})
    uploaded.raise_for_status()
    return str(uploaded.json()["id"])


def create_batch(client: httpx.Client, input_file_id: str) -> str:
    """Create a chat-completions batch (24 h window) of an uploaded input file; returns the
    batch's id."""
    created = client.post(
        "/v1/batches",
        json={
            "input_file_id": input_file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    created.raise_for_status()
    return str(created.json()["id"])
