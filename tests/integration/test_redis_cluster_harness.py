"""The benchmarks' and tests' own Redis Cluster (``worker.redis_cluster``) with fewer than the
three masters ``redis-cli --cluster create`` insists on: a one-shard cluster (what
``bench.fleet --redis-shards 1`` starts) serves every slot, and the ledger runs on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from backfill.ledger import Lease, Ledger, NodePool
from backfill.policy import ClassLimits, PoolPolicy, ServiceClass
from backfill.redis_client import connect
from worker.redis_cluster import LocalCluster

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
