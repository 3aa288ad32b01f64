"""Redis clients from ``BACKFILL_REDIS_URL``: one server or a Redis Cluster, blocking or asyncio.

- ``redis://``, ``rediss://``, ``unix://``: one Redis server (the default; redis-py's own URL
  forms, unchanged).
- ``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://...`` (TLS): a Redis
  Cluster. The hosts are seeds: the client learns the rest of the cluster from the first that
  answers, and follows slot moves and failovers by itself. A cluster has one database, so the
  URL has no database path (``/0`` at most); user and password apply to every node.

Every ledger key of one node shares that node's hash slot (:mod:`backfill.keys`), so each
ledger script runs on one shard; operations over several nodes (snapshots of all pools, the
rebuild, the node list) are one call per node, which the cluster client routes.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

SyncRedis: TypeAlias = redis.Redis | redis.cluster.RedisCluster
"""A blocking client: one server or a cluster."""

AsyncRedis: TypeAlias = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster
"""An asyncio client: one server or a cluster."""

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SERVER_SCHEMES = {"redis", "rediss", "unix"}


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in CLUSTER_SCHEMES


def cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """A cluster URL as redis-py's URL of its first seed (credentials, TLS and query kept, no
    database) and every seed as ``(host, port)``; ValueError when it is not one."""
    scheme, sep, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if plain is None or not sep:
        raise ValueError(f"not a Redis Cluster URL (redis+cluster://host:port): {url!r}")
    netloc, _, tail = rest.partition("/")
    path, qmark, query = tail.partition("?")
    if path not in ("", "0"):
        raise ValueError(f"a Redis Cluster has database 0 only: {url!r}")
    userinfo, at, hosts = netloc.rpartition("@")
    seeds: list[tuple[str, int]] = []
    for part in hosts.split(","):
        if part.startswith("["):  # [IPv6]:port
            host, _, after = part[1:].partition("]")
            port = after.removeprefix(":") or "6379"
        else:
            host, colon, port = part.partition(":")
            port = port if colon else "6379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad Redis Cluster seed {part!r} in {url!r}")
        seeds.append((host, int(port)))
    first = hosts.split(",")[0]
    return f"{plain}://{userinfo}{at}{first}{qmark}{query}", seeds


def check_url(url: str) -> str:
    """``url`` if it names one Redis server or a cluster; ValueError saying what is accepted."""
    scheme = url.partition("://")[0].lower()
    if scheme in CLUSTER_SCHEMES:
        cluster_seeds(url)
    elif scheme not in SERVER_SCHEMES:
        raise ValueError(
            "must be redis://, rediss://, unix:// (one server) or redis+cluster://, "
            f"rediss+cluster:// (a Redis Cluster): {url!r}"
        )
    return url


# How long a call waits on a silent Redis before it fails (and the caller retries or reports
# the ledger unavailable), and a connection on an unreachable one. redis-py 8 waits 5 s by
# default; the 5.x-7.x releases the dependency range allows wait forever, so a stopped server
# would hang a worker's heartbeat for good. A URL's own ``?socket_timeout=`` still wins.
SOCKET_TIMEOUT_S = 5.0


def _timeouts(options: dict[str, Any]) -> dict[str, Any]:
    options.setdefault("socket_timeout", SOCKET_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", SOCKET_TIMEOUT_S)
    return options


def connect(url: str, **options: Any) -> SyncRedis:
    """A blocking client for ``url`` (``options`` go to redis-py's constructor)."""
    options = _timeouts(options)
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **options)
    first, seeds = cluster_seeds(url)
    nodes = [redis.cluster.ClusterNode(h, p) for h, p in seeds[1:]]  # type: ignore[no-untyped-call]
    return redis.cluster.RedisCluster.from_url(first, startup_nodes=nodes, **options)


# Connections the asyncio cluster client may open to one shard. redis-py's default (100) is a
# hard limit: the 101st call in flight to a shard fails at once with MaxConnectionsError instead
# of waiting, which a busy API process (one ledger call per interactive admission) or a
# fleet-sized benchmark reaches. Redis itself accepts 10,000 clients.
ASYNC_CLUSTER_CONNECTIONS = 2_000


def connect_async(url: str, **options: Any) -> AsyncRedis:
    """An asyncio client for ``url`` (``options`` go to redis-py's constructor)."""
    options = _timeouts(options)
    if not is_cluster_url(url):
        return redis.asyncio.Redis.from_url(url, **options)
    options.setdefault("max_connections", ASYNC_CLUSTER_CONNECTIONS)
    first, seeds = cluster_seeds(url)
    nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in seeds[1:]]
    return redis.asyncio.cluster.RedisCluster.from_url(first, startup_nodes=nodes, **options)
