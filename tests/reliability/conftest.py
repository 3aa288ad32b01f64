"""Fixtures of the reliability suite: one small vLLM engine for the whole suite (a scenario
may crash and restart it on the same port), a deployment over it, and temporary folders for
the throwaway services.

``BACKFILL_RELIABILITY_ENGINE_URL`` points the suite at an engine started elsewhere (with 48
blocks of 128 tokens, as here); the engine-crash scenario then starts one of its own to kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy
from backfill.store import Repository
from devkit import devengine
from tests.reliability.support import Deployment

BLOCKS = 48
BLOCK = 128
CAPACITY = BLOCKS * BLOCK
ENGINE_FLAGS: dict[str, object] = {
    "num_gpu_blocks_override": BLOCKS,
    "max_model_len": 512,
    "kv_cache_gib": 1,
}

# Fast leases so that a dead worker is noticed within seconds (heartbeat < TTL / 2).
LEASE_TTL_S = 3.0
HEARTBEAT_S = 1.0
REAPER_S = 0.5


@dataclass
class EngineHandle:
    """The suite's engine; ``crash`` and ``start_again`` keep its URL (same port)."""

    url: str
    port: int
    server: devengine.EngineServer | None

    @property
    def owned(self) -> bool:
        return self.server is not None

    def crash(self) -> None:
        """kill -9 the engine's whole process group (API server and engine core)."""
        assert self.server is not None, "cannot crash an engine this suite did not start"
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.server.pid, signal.SIGKILL)
        self.server.process.wait(30)
        self.server.stop(grace_s=1)  # reaps what is left and removes its folder

    def start_again(self) -> None:
        self.server = devengine.start_model("tiny", port=self.port, **ENGINE_FLAGS)

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


def start_engine() -> EngineHandle:
    try:
        server = devengine.start_model("tiny", **ENGINE_FLAGS)
    except devengine.DevEngineError as exc:
        pytest.fail(f"could not provision a vLLM engine: {exc}", pytrace=False)
    return EngineHandle(server.url, server.port, server)


@pytest.fixture(scope="session")
def engine() -> Iterator[EngineHandle]:
    url = os.environ.get("BACKFILL_RELIABILITY_ENGINE_URL")
    if url:
        yield EngineHandle(url.rstrip("/"), int(url.rstrip("/").rsplit(":", 1)[1]), None)
        return
    handle = start_engine()
    try:
        yield handle
    finally:
        handle.close()


def fast_settings(settings: Settings, **overrides: object) -> Settings:
    values: dict[str, object] = {
        "lease_ttl_s": LEASE_TTL_S,
        "heartbeat_interval_s": HEARTBEAT_S,
        "reaper_interval_s": REAPER_S,
        "shutdown_grace_s": 2.0,
        "max_in_flight_per_node": 64,
    }
    values.update(overrides)
    return settings.model_copy(update=values)


def make_deployment(settings: Settings, engine_url: str) -> Deployment:
    repo = Repository.connect(settings.database_url, pool_size=4)
    ledger = Ledger.from_url(
        settings.redis_url,
        settings.redis_namespace,
        pool_policy(settings),
        lease_ttl_ms=int(settings.lease_ttl_s * 1000),
    )
    return Deployment(settings, repo, ledger, engine_url)


@pytest.fixture
def deployment(settings: Settings, engine: EngineHandle) -> Iterator[Deployment]:
    d = make_deployment(fast_settings(settings), engine.url)
    yield d
    d.ledger.close()
    d.repo.close()


@pytest.fixture
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bf-reliability-") as path:
        yield Path(path)
