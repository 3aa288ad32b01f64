"""Revoking an API key: every API process forgets it at once (Redis pub/sub), however long
its key cache remembers keys; the CLI names a key by its id and says what happened."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis
from batch_api_support import LiveServer, api_settings, make_tenant, serve

from backfill.config import Settings
from backfill.keycache import RevocationListener, TenantKeyCache, announce_revocation
from backfill.keys import key_revocations_channel
from backfill.store import Repository, TenantRecord, key_digest, key_id
from tests.conftest import REDIS_URL

BACKFILL = str(Path(sys.executable).parent / "backfill")
ACME = TenantRecord("tnt_1", "acme", None)


def _wait_for_listeners(client: redis.Redis, channel: str, n: int = 1) -> None:
    deadline = time.monotonic() + 20
    while dict(client.pubsub_numsub(channel)).get(channel.encode(), 0) < n:
        assert time.monotonic() < deadline, f"nobody subscribed to {channel}"
        time.sleep(0.05)


def test_an_announced_revocation_evicts_the_key_from_a_listening_cache(
    redis_client: redis.Redis, redis_namespace: str
) -> None:
    answers: dict[str, TenantRecord | None] = {"k": ACME}
    cache = TenantKeyCache(answers.get, 3600.0)
    listener = RevocationListener(
        redis.Redis.from_url(REDIS_URL), redis_namespace, cache, retry_s=0.1
    ).start()
    try:
        assert listener.subscribed.wait(20)
        assert cache.get("k") == ACME
        answers["k"] = None  # revoked in Postgres; the cache still says ACME
        assert cache.get("k") == ACME
        assert announce_revocation(redis_client, redis_namespace, [key_digest("k")]) == 1
        deadline = time.monotonic() + 20
        while cache.cached("k") != (False, None):
            assert time.monotonic() < deadline, "the revocation was not heard"
            time.sleep(0.02)
        assert cache.get("k") is None
    finally:
        listener.stop()


def _cli(settings: Settings, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "BACKFILL_DATABASE_URL": settings.database_url,
        "BACKFILL_REDIS_URL": settings.redis_url,
        "BACKFILL_REDIS_NAMESPACE": settings.redis_namespace,
        **env,
    }
    return subprocess.run(
        [BACKFILL, *args], env=environ, capture_output=True, text=True, timeout=60, check=False
    )


def test_a_key_revoked_by_its_id_stops_working_on_a_running_api_at_once(
    settings: Settings, repo: Repository, redis_client: redis.Redis
) -> None:
    # Was: revocation took the whole key, and an API process kept accepting it for as long
    # as its cache remembered it (5 s by default) while the CLI said "at once".
    tenant = make_tenant(repo, "acme")
    with serve(api_settings(settings, api_key_cache_s=3600.0)) as server:
        _wait_for_listeners(redis_client, key_revocations_channel(settings.redis_namespace))
        assert _batches(server, tenant.key).status_code == 200  # now remembered for an hour
        revoked = _cli(settings, "tenants", "revoke-key", key_id(tenant.key))
        assert revoked.returncode == 0, revoked.stderr
        assert f"revoked key {key_id(tenant.key)}... of tenant acme" in revoked.stdout
        assert "1 API process(es) heard it" in revoked.stdout
        refused = _batches(server, tenant.key)
    assert refused.status_code == 401
    assert refused.json()["error"]["code"] == "invalid_api_key"


def _batches(server: LiveServer, key: str) -> httpx.Response:
    return httpx.get(
        f"{server.base_url}/v1/batches", headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_without_redis_the_cli_says_revocation_takes_up_to_the_cache_ttl(
    settings: Settings, repo: Repository
) -> None:
    tenant = make_tenant(repo, "acme")
    revoked = _cli(
        settings, "tenants", "revoke-key", tenant.key, BACKFILL_REDIS_URL="redis://127.0.0.1:1/0"
    )
    assert revoked.returncode == 0, revoked.stderr
    assert "Redis unreachable" in revoked.stdout
    assert "within 5 s (BACKFILL_API_KEY_CACHE_S)" in revoked.stdout
    assert repo.tenants.tenant_for_key(tenant.key) is None
