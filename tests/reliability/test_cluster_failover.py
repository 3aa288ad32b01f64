"""Scenario 5b (fleet scale): the ledger on a Redis Cluster, one of its masters killed under a
running job.

The ledger runs on a Redis Cluster of three masters with a replica each, as a fleet runs it;
Celery's broker stays one Redis server (Celery cannot use a cluster). While items run, the
master that serves the workers' node (its pool, leases, fencing counter) is killed with
SIGKILL: until its replica is promoted (the cluster node timeout and an election) the node's
ledger calls wait in the client's retries, then fail, and the workers retry them; the replica
serves what replication had delivered to it, and the workers go on against it. An item whose
claim lapsed meanwhile (the suite's lease TTL is about a failover long) is requeued and run
again, and its first attempt's late result is refused by its fence.

What must hold: the job completes with every item succeeded exactly once (none lost, none
doubled), no worker dies of the failover, no lease is left reserved at the end, and no sampled
moment, through the failover, over-commits the node's pool.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backfill.config import Settings
from backfill.states import ItemState
from devkit.redis_cluster import NODE_TIMEOUT_MS, LocalCluster
from tests.reliability.conftest import (
    LEASE_TTL_S,
    REAPER_S,
    EngineHandle,
    fast_settings,
    make_deployment,
)
from tests.reliability.support import maintenance, report, sampling
from tests.reliability.test_worker_kill import deployment_workers

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def cluster(workdir: Path) -> Iterator[LocalCluster]:
    # A cluster of this test's own: the session's (``redis_cluster``) must keep its masters.
    own = LocalCluster(workdir / "cluster")
    try:
        yield own.start()
    finally:
        own.stop()


def test_a_cluster_master_killed_under_a_job_fails_over_and_the_job_completes(
    settings: Settings, engine: EngineHandle, cluster: LocalCluster, workdir: Path
) -> None:
    # The ledger on the cluster; Celery's broker on the suite's one Redis server. The test's
    # own namespace keeps its maintenance queue there apart from any other run's.
    s = fast_settings(
        settings,
        redis_url=cluster.url,
        broker_url=settings.redis_url,
        redis_namespace=settings.redis_namespace,
    )
    d = make_deployment(s, engine.url)
    # Kill the shard of the node's keys, not the shard of the ledger's own keys (the rebuilt
    # marker and the node set, in the ``{ledger}`` slot): a failover of that one is the loss
    # of the marker every node reads, which closes batch admission on all nodes until a
    # rebuild (scenario 5's path); here the node's pool and leases fail over under its
    # running items.
    victim = cluster.master_of(d.ledger.keys.pool(d.node))
    assert victim.port != cluster.master_of(d.ledger.keys.built).port, (
        f"node {d.node}'s keys share a shard with the ledger's own: pick another node name"
    )
    replica = cluster.replica_of(victim)
    n = 240
    job = d.submit(n, max_tokens=24, tag="cluster")
    workers = deployment_workers(d, workdir, 2)
    for w in workers:
        # The workers' Settings refuse a cluster URL without a broker of one server.
        w.env["BACKFILL_BROKER_URL"] = settings.redis_url
    try:
        with maintenance(d, REAPER_S) as upkeep, sampling(d.ledger, d.node, s) as samples:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready()
            # Mid-job: some items done, the node's pool busy with running ones.
            d.wait(
                lambda: d.done(job) >= n // 5 and d.counts(job).get(ItemState.RUNNING, 0) >= 10,
                120,
                "items done and items running",
            )
            in_flight = d.counts(job).get(ItemState.RUNNING, 0)
            done_before = d.done(job)
            unavailable_before = samples.unavailable
            rebuilds_before = upkeep.rebuilds
            killed = time.monotonic()
            cluster.kill(victim)
            # The other masters mark it failed after the node timeout and its replica takes
            # over its slots.
            cluster.wait_healthy(timeout_s=60)
            failover_s = time.monotonic() - killed
            assert cluster.master_of(d.ledger.keys.pool(d.node)).port == replica.port
            done_at_failover = d.done(job)
            # Admission goes on against the promoted replica: new items complete after it.
            resumed_s = d.wait(
                lambda: d.done(job) > done_at_failover + 20, 120, "items to complete again"
            )
            d.wait(lambda: d.done(job) == n, 300, "every item")
            elapsed = time.monotonic() - killed
            d.assert_no_leak(timeout=LEASE_TTL_S + 10)
            # No worker died of an error the failover raised: each finished its share.
            for w in workers:
                assert w.alive(), f"a worker exited:\n{w.log_text()[-3000:]}"
                assert "stopped on an error" not in w.log_text(), w.log_text()[-3000:]
            for w in workers:
                w.terminate()
            # Items whose claim lapsed while their heartbeat waited on the failing shard ran
            # again; the first attempts' late results were refused by their fence (stale).
            stale = sum(w.stats().get("stale_results", 0) for w in workers)
    finally:
        for w in workers:
            w.close()
        d.ledger.close()
    once = d.assert_exactly_once(job, n)
    d.repo.close()
    report(
        "5b Redis Cluster master kill -9 and replica failover",
        items=n,
        running_at_kill=in_flight,
        done_at_kill=done_before,
        failover_s=round(failover_s, 2),
        completing_again_after_s=round(failover_s + resumed_s, 2),
        finished_after_kill_s=round(elapsed, 1),
        rebuilds_after_kill=upkeep.rebuilds - rebuilds_before,
        lost=once["lost"],
        doubled=once["doubled"],
        stale_results_fenced=stale,
        ledger_samples=samples.samples,
        unavailable_samples=samples.unavailable - unavailable_before,
        peak_batch_tokens=samples.peak_batch,
        batch_limit=samples.batch_limit,
        overcommits=len(samples.violations),
    )
    assert failover_s > NODE_TIMEOUT_MS / 1000  # a real failover, not a master that stayed
    assert not samples.violations, samples.violations[:5]
    assert samples.peak_batch <= samples.batch_limit
