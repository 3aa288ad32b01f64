"""Redis Cluster URLs and the key layout that keeps each node's ledger in one hash slot."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio.cluster
from pydantic import ValidationError
from redis.crc import key_slot

from backfill.config import Settings
from backfill.keys import LedgerKeys
from backfill.redis_client import (
    SOCKET_TIMEOUT_S,
    check_url,
    cluster_seeds,
    connect,
    connect_async,
    is_cluster_url,
)
from worker.celery_app import make_app


@pytest.mark.parametrize(
    ("url", "first", "seeds"),
    [
        ("redis+cluster://10.0.0.1:7000", "redis://10.0.0.1:7000", [("10.0.0.1", 7000)]),
        (
            "rediss+cluster://u:p%40ss@a:7000,b:7001/0?ssl_cert_reqs=none",
            "rediss://u:p%40ss@a:7000?ssl_cert_reqs=none",
            [("a", 7000), ("b", 7001)],
        ),
        ("redis+cluster://[::1]:7000,host", "redis://[::1]:7000", [("::1", 7000), ("host", 6379)]),
    ],
)
def test_a_cluster_url_names_its_seeds(url: str, first: str, seeds: list[tuple[str, int]]) -> None:
    assert is_cluster_url(url)
    assert cluster_seeds(url) == (first, seeds)


@pytest.mark.parametrize(
    "bad",
    [
        "redis+cluster://h:7000/1",  # a cluster has database 0 only
        "redis+cluster://h:port",
        "redis+cluster://:7000",
        "memcached://h:1",
    ],
)
def test_a_bad_redis_url_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=r"cluster|database|must be"):
        check_url(bad)


def test_one_server_keeps_redis_py_own_urls() -> None:
    for url in ("redis://h:6379/0", "rediss://h:6380/2", "unix:///run/redis.sock"):
        assert not is_cluster_url(url)
        assert check_url(url) == url
    assert isinstance(connect("redis://127.0.0.1:1/0"), redis.Redis)  # connects lazily


def test_settings_take_a_cluster_only_with_a_broker_for_celery() -> None:
    with pytest.raises(ValidationError, match="BACKFILL_BROKER_URL"):
        Settings(redis_url="redis+cluster://h:7000")
    s = Settings(redis_url="redis+cluster://h:7000", broker_url="redis://q:6379/0")
    assert s.celery_broker_url == "redis://q:6379/0"
    assert Settings().celery_broker_url == Settings().redis_url
    assert make_app(s).conf.broker_url == "redis://q:6379/0"  # Celery never sees the cluster
    with pytest.raises(ValidationError, match="Celery cannot use a Redis Cluster"):
        Settings(broker_url="redis+cluster://h:7000")


def test_every_key_of_a_node_shares_the_node_slot_and_nodes_spread() -> None:
    keys = LedgerKeys("bf")
    slots = set()
    for node in [f"gpu-{i}" for i in range(32)] + ["we{ir}d", "a}b"]:
        nk = keys.node(node)
        node_keys = nk.keys()
        assert {key_slot(k.encode()) for k in node_keys} == {key_slot(nk.pool.encode())}
        assert keys.node_from_pool_key(keys.pool(node)) == node
        slots.add(key_slot(nk.pool.encode()))
    assert len(slots) > 16  # one slot per node, not one for the whole ledger
    assert key_slot(keys.built.encode()) == key_slot(keys.members.encode())
    assert keys.pool("gpu-0").startswith("bf:")  # SCAN MATCH bf:* finds every key


def test_a_client_waits_a_bounded_time_on_a_silent_redis_and_a_url_may_say_otherwise() -> None:
    """redis-py before 8 waits forever by default; a stopped ledger must fail a call instead."""
    client = connect("redis://127.0.0.1:6379/0")
    told = connect("redis://127.0.0.1:6379/0?socket_timeout=2")
    aclient = connect_async("redis://127.0.0.1:6379/0")
    acluster = connect_async("redis+cluster://127.0.0.1:7000")
    try:
        for c in (client, aclient):
            kwargs = c.connection_pool.connection_kwargs  # type: ignore[union-attr]
            assert kwargs["socket_timeout"] == SOCKET_TIMEOUT_S
            assert kwargs["socket_connect_timeout"] == SOCKET_TIMEOUT_S
        told_kwargs = told.connection_pool.connection_kwargs  # type: ignore[union-attr]
        assert told_kwargs["socket_timeout"] == 2
        assert isinstance(acluster, redis.asyncio.cluster.RedisCluster)
        cluster_kwargs = acluster.nodes_manager.connection_kwargs
        assert cluster_kwargs["socket_timeout"] == SOCKET_TIMEOUT_S
    finally:
        client.close()
        told.close()
