"""The benchmarks' and tests' own Redis Cluster (``devkit.redis_cluster``) with fewer than the
three masters ``redis-cli --cluster create`` insists on: a one-shard cluster (what
``bench.fleet --redis-shards 1`` starts) serves every slot, and the ledger runs on it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from backfill.ledger import Lease, Ledger, NodePool
from backfill.policy import ClassLimits, PoolPolicy, ServiceClass
from backfill.redis_client import connect
from devkit import redis_cluster
from devkit.redis_cluster import LocalCluster

POLICY = PoolPolicy(interactive=ClassLimits(4096), batch=ClassLimits(4096))


@pytest.mark.parametrize("masters", [1, 2])
def test_a_cluster_of_fewer_than_three_masters_serves_every_slot(
    tmp_path: Path, masters: int
) -> None:
    cluster = LocalCluster(tmp_path, masters=masters, replicas=0).start()
    try:
        client = connect(cluster.url)
        for i in range(200):
            client.set(f"k{i}", i)
        assert sum(int(client.get(f"k{i}") or 0) for i in range(200)) == sum(range(200))
        client.close()
        ledger = Ledger.from_url(cluster.url, "bfh", POLICY)
        ledger.rebuild([NodePool(f"n{i}", 4096, 16) for i in range(4)], [], epoch=1)
        leases = [ledger.reserve(f"n{i}", ServiceClass.BATCH, 10, 10) for i in range(4)]
        assert all(isinstance(x, Lease) for x in leases)
        assert ledger.is_ready()
        ledger.close()
    finally:
        cluster.stop()
    assert not cluster.live()


def test_replicas_need_three_masters(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="without replicas"):
        LocalCluster(tmp_path, masters=1, replicas=1).start()


def test_a_node_whose_port_is_taken_before_it_binds_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race a busy machine runs: a port free when checked is taken before the node binds
    it (the node exits at once); the node starts again elsewhere, not a minute's wait."""
    # Bound, not listening: as a client connection's local port (a ping there is refused).
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    taken = int(squatter.getsockname()[1])
    real = redis_cluster._free_port
    picks = iter([taken])
    monkeypatch.setattr(redis_cluster, "_free_port", lambda t=(): next(picks, None) or real(t))
    try:
        cluster = LocalCluster(tmp_path, masters=1, replicas=0).start(timeout_s=20)
        try:
            assert [n.port for n in cluster.nodes] != [taken]
            client = connect(cluster.url)
            client.set("k", 1)
            assert client.get("k") == b"1"
            client.close()
        finally:
            cluster.stop()
    finally:
        squatter.close()
