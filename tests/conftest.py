"""Fixtures shared by every test layer.

Postgres isolation: one template database is migrated once per test session; each test that
asks for ``database_url`` gets a fresh database cloned from it (``CREATE DATABASE ... TEMPLATE``),
so tests may commit, run concurrent claimers, and leave whatever they like behind.
Redis isolation: each test gets its own ledger namespace (key prefix) and its keys are
deleted afterwards, so tests can run beside a live deployment or each other.
Redis Cluster: tests that ask for ``ledger_redis_url`` run twice, on the one Redis server and on
a real three-master cluster this session starts from the installed ``redis-server``
(``devkit/redis_cluster.py``).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
import pytest
import redis
from hypothesis import HealthCheck, settings

from backfill.config import Settings, libpq_url, normalise_database_url
from backfill.redis_client import SyncRedis, connect
from devkit.redis_cluster import LocalCluster
from migrations.migrate import upgrade

# Property tests judge what a function returns, never how fast: hypothesis's per-example time
# limit (200 ms) and its too-slow health check fail them on a busy machine (seen: an LRU trace of
# 200 steps over the limit while benchmarks shared the 2 cores).
settings.register_profile("backfill", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("backfill")

# The layers' shared helpers assert too: their failures are explained as a test's own are.
pytest.register_assert_rewrite(
    "batch_api_support",
    "standin_engine",
    "tests.integration.batch_api_support",
    "tests.integration.standin_engine",
    "tests.e2e.helpers",
)

ADMIN_URL = normalise_database_url(
    os.environ.get("BACKFILL_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/test")
)
REDIS_URL = os.environ.get("BACKFILL_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _url_for(dbname: str) -> str:
    base, _, _ = ADMIN_URL.rpartition("/")
    return f"{base}/{dbname}"


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(libpq_url(ADMIN_URL), autocommit=True)


@pytest.fixture(scope="session")
def template_database() -> Iterator[str]:
    """A database at migration head, used only as a template to clone."""

    name = f"bf_tpl_{os.getpid()}_{secrets.token_hex(3)}"
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        upgrade(_url_for(name))
        yield name
    finally:
        with _admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextmanager
def _scratch_database(prefix: str, template: str | None = None) -> Iterator[str]:
    name = f"{prefix}_{os.getpid()}_{secrets.token_hex(4)}"
    clause = f' TEMPLATE "{template}"' if template else ""
    with _admin() as conn:
        conn.execute(f'CREATE DATABASE "{name}"{clause}')
    try:
        yield _url_for(name)
    finally:
        with _admin() as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def database_url(template_database: str) -> Iterator[str]:
    """A fresh, migrated database of this test's own (SQLAlchemy URL)."""
    with _scratch_database("bf_t", template_database) as url:
        yield url


@pytest.fixture(scope="module")
def module_database_url(template_database: str) -> Iterator[str]:
    """A fresh, migrated database shared by one test module (e.g. Hypothesis examples)."""
    with _scratch_database("bf_m", template_database) as url:
        yield url


@pytest.fixture
def empty_database_url() -> Iterator[str]:
    """A fresh database with no schema at all (for migration tests)."""
    with _scratch_database("bf_e") as url:
        yield url


@pytest.fixture
def redis_namespace() -> Iterator[str]:
    """A ledger key prefix of this test's own; its keys are removed afterwards."""
    namespace = f"bft{secrets.token_hex(4)}"
    yield namespace
    client = redis.Redis.from_url(REDIS_URL)
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """Three masters with a replica each, for this session (started on first use)."""
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(params=["server", "cluster"])
def ledger_redis_url(request: pytest.FixtureRequest, redis_namespace: str) -> Iterator[str]:
    """Where the ledger tests run: the one Redis server, then the session's Redis Cluster
    (whose keys of this test's namespace are removed afterwards)."""
    if request.param == "server":
        yield REDIS_URL
        return
    cluster: LocalCluster = request.getfixturevalue("redis_cluster")
    yield cluster.url
    client = connect(cluster.url)
    try:
        for key in list(client.scan_iter(match=f"{redis_namespace}:*", count=1000)):
            client.delete(key)
    finally:
        client.close()


@pytest.fixture
def ledger_client(ledger_redis_url: str) -> Iterator[SyncRedis]:
    """A client of the server or the cluster this ledger test runs on (``ledger_redis_url``)."""
    client = connect(ledger_redis_url)
    yield client
    client.close()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL)
    yield client
    client.close()


@pytest.fixture
def settings(database_url: str, redis_namespace: str) -> Settings:
    """Settings pointing at this test's own database and Redis namespace. A create of a file
    of up to 1 MiB is checked and stored in its request (the product defers every create to
    an ingest process): most tests create a batch through the store, with no ingest process,
    and use its items at once. The default's path has tests of its own
    (``test_deferred_ingest.py``, ``test_ingest_overlap.py``)."""
    return Settings(
        database_url=database_url,
        redis_url=REDIS_URL,
        redis_namespace=redis_namespace,
        ingest_inline_bytes=1 << 20,
    )
