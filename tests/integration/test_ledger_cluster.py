"""The ledger on a real Redis Cluster: nodes spread over the shards, a shard that loses its data
closes only its own nodes, and a master killed during ledger activity (its replica promoted)
leaves no lease unaccounted for and no pool over its capacity.

The rest of the ledger's tests run on the cluster too (``ledger_redis_url``); these need more
than one shard to mean anything.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from redis.crc import key_slot

from backfill.errors import LedgerUnavailable
from backfill.ledger import ActiveLease, Lease, LeaseStatus, Ledger, NodePool, ReserveRequest
from backfill.maintenance import ensure_ledger
from backfill.policy import Reason, ServiceClass
from backfill.store import Repository
from devkit.redis_cluster import NODE_TIMEOUT_MS, LocalCluster
from tests.integration.test_ledger import at
from tests.integration.test_maintenance import _running_items
from tests.support_policy import pool_policy

POLICY = pool_policy(4096, 4096, 1024, 256, 64)
CAPACITY = 16_384
CEILING = CAPACITY - 1024 - 64
"""The most batch may hold on a node: capacity less the reserve and the safety margin."""
NODES = [f"gpu-{i}" for i in range(9)]
BATCH = ServiceClass.BATCH


@pytest.fixture
def ledger(redis_cluster: LocalCluster, redis_namespace: str) -> Iterator[Ledger]:
    ledger = Ledger.from_url(redis_cluster.url, redis_namespace, POLICY, lease_ttl_ms=600_000)
    yield ledger
    client = ledger.client
    for key in list(client.scan_iter(match=f"{redis_namespace}:*")):
        client.delete(key)
    ledger.close()


def shards(cluster: LocalCluster, ledger: Ledger) -> dict[int, list[str]]:
    """Master port -> the nodes whose ledger it holds."""
    out: dict[int, list[str]] = {}
    for n in NODES:
        out.setdefault(cluster.master_of(ledger.keys.pool(n)).port, []).append(n)
    return out


def test_each_node_keeps_its_keys_in_one_slot_and_nodes_spread_over_shards(
    redis_cluster: LocalCluster, ledger: Ledger
) -> None:
    for n in NODES:
        node_keys = ledger.keys.node(n).keys()
        assert len({key_slot(k.encode()) for k in node_keys}) == 1
    assert len(shards(redis_cluster, ledger)) == 3
    ledger.rebuild([NodePool(n, CAPACITY, 16) for n in NODES], [], epoch=1)
    assert ledger.is_ready()
    leases = [_admitted(x) for x in ledger.reserve_many([_request(n, 100) for n in NODES])]
    assert ledger.nodes() == sorted(NODES)
    # A preemption is published by the script on the node's shard; classic pub/sub reaches
    # a subscriber on whichever node of the cluster its connection landed.
    with ledger.listen_preemptions(NODES[0]) as listener:
        assert ledger.preempt(NODES[0], 1, victims=[leases[0].lease_id]).victims == (
            leases[0].lease_id,
        )
        assert listener.get(timeout=5.0) == leases[0].lease_id
    assert ledger.release_many(leases)[1:] == [LeaseStatus.RELEASED] * (len(NODES) - 1)


def test_a_shard_that_loses_its_data_closes_only_its_nodes_until_the_rebuild(
    redis_cluster: LocalCluster, ledger: Ledger
) -> None:
    ledger.rebuild([NodePool(n, CAPACITY, 16) for n in NODES], [], epoch=1)
    held = {n: _admitted(ledger.reserve(n, BATCH, 500, 500)) for n in NODES}
    by_shard = shards(redis_cluster, ledger)
    # A shard other than the one of the ledger's own keys (losing those closes every node).
    ledger_port = redis_cluster.master_of(ledger.keys.built).port
    lost_port = next(p for p in by_shard if p != ledger_port)
    lost = set(by_shard[lost_port])

    master = next(x for x in redis_cluster.nodes if x.port == lost_port)
    assert redis_cluster.lose_keys(master, f"{ledger.keys.namespace}:*") > 0

    assert not ledger.is_ready()
    for n in NODES:
        result = ledger.reserve(n, BATCH, 1, 1)
        if n in lost:
            assert not isinstance(result, Lease)
            assert result.reason is Reason.LEDGER_REBUILDING
        else:
            assert ledger.release(_admitted(result)) is LeaseStatus.RELEASED  # others go on
    # What Postgres holds: every batch lease given out above.
    records = [
        ActiveLease(x.lease_id, x.node, x.tokens, x.fencing_token, at(x.expires_at_ms))
        for x in held.values()
    ]
    report = ledger.rebuild([NodePool(n, CAPACITY, 16) for n in NODES], records, epoch=2)
    assert (report.restored, report.skipped) == (len(lost), len(NODES) - len(lost))
    assert ledger.is_ready()
    for n in NODES:
        snap = ledger.snapshot(n)
        assert snap is not None
        assert [x.lease_id for x in snap.leases] == [held[n].lease_id]
        assert ledger.release(held[n]) is LeaseStatus.RELEASED


def test_the_maintenance_tick_rebuilds_a_lost_shard_from_postgres(
    redis_cluster: LocalCluster, repo: Repository, redis_namespace: str
) -> None:
    ledger = Ledger.from_url(redis_cluster.url, redis_namespace, POLICY)
    try:
        _running_items(repo, ledger, 3)
        before = ledger.snapshot("n1")
        assert before is not None
        master = redis_cluster.master_of(ledger.keys.pool("n1"))
        redis_cluster.lose_keys(master, f"{redis_namespace}:*")
        assert not ledger.is_ready()
        assert ledger.register_pool("n1", 64 * 128, 128) == 0  # its worker, before the tick
        report = ensure_ledger(repo, ledger, max_preemptions=3)
        assert report is not None
        assert report.restored == 3
        after = ledger.snapshot("n1")
        assert after is not None
        assert after.ready
        assert {x.lease_id for x in after.leases} == {x.lease_id for x in before.leases}
        assert ensure_ledger(repo, ledger, max_preemptions=3) is None
    finally:
        for key in list(ledger.client.scan_iter(match=f"{redis_namespace}:*")):
            ledger.client.delete(key)
        ledger.close()


# -- a failover under load


@dataclass
class Holder:
    """One node's worker, as the ledger sees it: reserves, heartbeats and releases batch
    leases in a loop, retrying a call the cluster could not answer (reserve with the same lease
    id, so a retry never takes tokens twice)."""

    url: str
    namespace: str
    node: str
    seed: int
    held: dict[str, Lease] = field(default_factory=dict)
    lost: list[Lease] = field(default_factory=list)
    """Leases the ledger answered 'unknown' for: acknowledged, then lost by replication."""
    admitted_at: list[float] = field(default_factory=list)
    unavailable_at: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        ledger = Ledger.from_url(self.url, self.namespace, POLICY, lease_ttl_ms=600_000)
        rng = random.Random(self.seed)
        try:
            while not stop.is_set():
                self._step(ledger, rng)
        except Exception as exc:  # reported by the test
            self.problems.append(repr(exc))
        finally:
            ledger.close()

    def _retrying(self, call: object) -> object:
        assert callable(call)
        deadline = time.monotonic() + 30
        while True:
            try:
                return call()
            except LedgerUnavailable:
                self.unavailable_at.append(time.monotonic())
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _step(self, ledger: Ledger, rng: random.Random) -> None:
        if len(self.held) < 6 and rng.random() < 0.6:
            req = _request(self.node, rng.randint(1, 1500))
            result = self._retrying(
                lambda: ledger.reserve(
                    req.node,
                    BATCH,
                    req.prompt_tokens,
                    req.max_output_tokens,
                    lease_id=req.lease_id,
                )
            )
            if isinstance(result, Lease):
                self.held[result.lease_id] = result
                self.admitted_at.append(time.monotonic())
            elif result.reason not in self._fair_denials():  # type: ignore[attr-defined]
                self.problems.append(f"reserve denied: {result}")
        elif self.held:
            lease = self.held[rng.choice(sorted(self.held))]
            if rng.random() < 0.5:
                beat = self._retrying(
                    lambda: ledger.heartbeat(lease.node, lease.lease_id, lease.fencing_token)
                )
                self._check(ledger, lease, beat.status)  # type: ignore[attr-defined]
            else:
                status = self._retrying(lambda: ledger.release(lease))
                # A release of a lease the failover lost answers 'unknown' and remembers it
                # released with its fencing token: it ended, as the holder meant, and a rebuild
                # rightly skips it (as the worker, which only treats an unknown heartbeat as
                # lost). Counting it lost made the rebuild's count look short, beside load.
                if status is not LeaseStatus.UNKNOWN:
                    self._check(ledger, lease, status)  # type: ignore[arg-type]
                self.held.pop(lease.lease_id, None)

    def _fair_denials(self) -> set[Reason]:
        # After a lost lease the node waits for its rebuild.
        return {Reason.NO_SLACK, Reason.LEDGER_REBUILDING} if self.lost else {Reason.NO_SLACK}

    def _check(self, ledger: Ledger, lease: Lease, status: LeaseStatus) -> None:
        if status is LeaseStatus.UNKNOWN:
            # As the worker does: the work goes on, the node waits for a rebuild.
            self.lost.append(lease)
            self.held.pop(lease.lease_id, None)
            self._retrying(lambda: ledger.mark_incomplete(self.node))
        elif status not in (LeaseStatus.OK, LeaseStatus.RELEASED, LeaseStatus.ALREADY_RELEASED):
            self.problems.append(f"{lease.lease_id}: {status}")


@pytest.mark.slow
def test_a_master_killed_during_ledger_activity_loses_no_lease_and_overcommits_nothing(
    tmp_path_factory: pytest.TempPathFactory, redis_namespace: str
) -> None:
    cluster = LocalCluster(tmp_path_factory.mktemp("failover"))
    try:
        cluster.start()
        ledger = Ledger.from_url(cluster.url, redis_namespace, POLICY, lease_ttl_ms=600_000)
        ledger.rebuild([NodePool(n, CAPACITY, 16) for n in NODES], [], epoch=1)
        by_shard = shards(cluster, ledger)
        ledger_port = cluster.master_of(ledger.keys.built).port
        # Kill a master that holds nodes but not the ledger's own keys (a loss of those closes
        # every node, the test below of a lost shard shows that path).
        victim_port = next(p for p in by_shard if p != ledger_port)
        victim = next(x for x in cluster.nodes if x.port == victim_port)
        on_victim = set(by_shard[victim_port])
        replica = cluster.replica_of(victim)
        holders = [Holder(cluster.url, redis_namespace, n, i) for i, n in enumerate(NODES)]
        stop = threading.Event()
        threads = [threading.Thread(target=h.run, args=(stop,)) for h in holders]
        for t in threads:
            t.start()
        time.sleep(1.5)
        killed_at = time.monotonic()
        cluster.kill(victim)
        cluster.wait_healthy(timeout_s=60)
        healthy_at = time.monotonic()
        # Each holder admits again after the failover (or waits for a rebuild, having lost a
        # lease): waited for, not slept for, so a loaded machine's slow holders are not read
        # as a node that stopped admitting (it failed so beside busy loops: 1.5 s was short).
        settle_by = healthy_at + 60
        while time.monotonic() < settle_by and not all(
            h.lost or any(t > healthy_at for t in h.admitted_at) for h in holders
        ):
            time.sleep(0.1)
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=60)
            assert not t.is_alive()

        assert [p for h in holders for p in h.problems] == []
        assert healthy_at - killed_at > NODE_TIMEOUT_MS / 1000
        # The replica took over the killed master's slots.
        assert cluster.master_of(ledger.keys.pool(min(on_victim))).port == replica.port
        for h in holders:
            # Every node admitted after the failover (unless it waits for a rebuild); the
            # others never stopped admitting.
            assert h.lost or any(t > healthy_at for t in h.admitted_at), h.node
            if h.node not in on_victim:
                assert any(killed_at <= t <= healthy_at for t in h.admitted_at), h.node
                assert h.lost == [], h.node

        # A holder learns of a lost lease at its next heartbeat: here, for every lease at once.
        for h in holders:
            for lease in list(h.held.values()):
                beat = ledger.heartbeat(h.node, lease.lease_id, lease.fencing_token)
                h._check(ledger, lease, beat.status)
        # Nothing over-committed: each pool counts exactly its live leases, within the batch
        # ceiling; every lease a holder still holds is one of them.
        for h in holders:
            snap = ledger.snapshot(h.node)
            assert snap is not None
            assert snap.ready == (h.lost == [])  # a node that lost a lease waits for a rebuild
            assert snap.batch_in_use == sum(x.tokens for x in snap.leases) <= CEILING
            live = {x.lease_id for x in snap.leases}
            assert set(h.held) <= live, h.node
            if h.node not in on_victim:
                assert set(h.held) == live, h.node

        # No lease lost for good: one acknowledged in the instant before the kill and not yet
        # copied to the replica is gone from Redis (replication is asynchronous), but its
        # holder was told ('unknown', so it stops using it) and Postgres still records it: the
        # rebuild puts it back, with fencing tokens past every one handed out before. (A
        # release lost the same way leaves its lease counted until it expires: safe.)
        lost = [x for h in holders for x in h.lost]
        assert ledger.is_ready() == (lost == [])  # the maintenance tick's cue to rebuild
        records = [
            ActiveLease(x.lease_id, x.node, x.tokens, x.fencing_token, at(x.expires_at_ms))
            for h in holders
            for x in [*h.held.values(), *h.lost]
        ]
        snaps = {h.node: ledger.snapshot(h.node) for h in holders if h.lost}
        still = {n: [x.lease_id for x in snap.leases] for n, snap in snaps.items() if snap}
        report = ledger.rebuild([NodePool(n, CAPACITY, 16) for n in NODES], records, epoch=2)
        assert report.restored == len(lost), (report, [(x.lease_id, x.node) for x in lost], still)
        fences = [x.fencing_token for x in records]
        for h in holders:
            snap = ledger.snapshot(h.node)
            assert snap is not None
            assert {x.lease_id for x in [*h.held.values(), *h.lost]} <= {
                x.lease_id for x in snap.leases
            }
            assert (
                snap.batch_in_use
                == sum(x.tokens for x in snap.leases)
                <= CEILING + sum(x.tokens for x in h.lost)
            )
            assert _admitted(ledger.reserve(h.node, BATCH, 1, 1)).fencing_token > max(fences)
        ledger.close()
    finally:
        cluster.stop()


def _request(node: str, tokens: int) -> ReserveRequest:
    return ReserveRequest(node, BATCH, tokens // 2, max(1, tokens - tokens // 2))


def _admitted(result: object) -> Lease:
    assert isinstance(result, Lease), result
    return result


def test_a_shard_without_the_scripts_runs_every_call_from_its_source(
    redis_cluster: LocalCluster, ledger: Ledger
) -> None:
    """A replica promoted by a failover has none of the scripts (Redis 7 neither replicates
    nor persists SCRIPT LOAD), and a client's SCRIPT LOAD then may go by its stale view of
    the cluster: run 15 of the flake hunt saw a heartbeat refused with NOSCRIPT after a
    failover. A call a shard refuses so runs as EVAL, which goes where its keys are."""
    ledger.rebuild([NodePool(n, CAPACITY, 16) for n in NODES], [], epoch=1)
    for master in {redis_cluster.master_of(ledger.keys.pool(n)).port for n in NODES}:
        node = next(x for x in redis_cluster.nodes if x.port == master)
        node.client().script_flush()
    # Pipelined (one call per node, each on its shard) and single calls alike.
    leases = [_admitted(x) for x in ledger.reserve_many([_request(n, 100) for n in NODES])]
    for master in {redis_cluster.master_of(ledger.keys.pool(n)).port for n in NODES}:
        node = next(x for x in redis_cluster.nodes if x.port == master)
        node.client().script_flush()
    assert ledger.release(leases[0]) is LeaseStatus.RELEASED
    assert ledger.release_many(leases[1:]) == [LeaseStatus.RELEASED] * (len(NODES) - 1)
