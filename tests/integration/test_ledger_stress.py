"""Several processes reserve and release on one pool at once, mixed classes, with interactive
preempting batch; a monitor process reads snapshots the whole time. The pool must never go over
capacity, and must end exactly at zero. On one Redis server and on a Redis Cluster."""

from __future__ import annotations

import multiprocessing as mp
import random
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import pytest

from backfill.ledger import Lease, LeaseStatus, Ledger, NodePool
from backfill.policy import ServiceClass
from tests.support_policy import pool_policy

NODE = "gpu0"
CAPACITY = 16_384
PROCESSES = 4
PAIRS = 1_500
POLICY = pool_policy(4096, 4096, 4096, 512, 256)


def _holder(
    url: str, namespace: str, seed: int, results: Queue[tuple[int, int, int, list[str]]]
) -> None:
    ledger = Ledger.from_url(url, namespace, POLICY, lease_ttl_ms=600_000)
    rng = random.Random(seed)
    held: list[Lease] = []
    admitted = denied = preempted = 0
    bad: list[str] = []

    def release_one() -> None:
        nonlocal preempted
        lease = held.pop(rng.randrange(len(held)))
        status = ledger.release(lease)
        if status is LeaseStatus.PREEMPTED:
            preempted += 1
        elif status is not LeaseStatus.RELEASED:
            bad.append(f"release of {lease.lease_id}: {status}")

    for _ in range(PAIRS):
        cls = ServiceClass.INTERACTIVE if rng.random() < 0.3 else ServiceClass.BATCH
        result = ledger.reserve(
            NODE,
            cls,
            rng.randint(0, 1500),
            rng.randint(1, 1500),
            preemptible=rng.random() < 0.9,
            owner=f"p{seed}",
        )
        if isinstance(result, Lease):
            admitted += 1
            held.append(result)
        else:
            denied += 1
        while held and len(held) > rng.randint(0, 3):
            release_one()
    while held:
        release_one()
    ledger.close()
    results.put((admitted, denied, preempted, bad))


def _monitor(url: str, namespace: str, stop: Event, results: Queue[tuple[int, list[str]]]) -> None:
    ledger = Ledger.from_url(url, namespace, POLICY)
    seen = 0
    bad: list[str] = []
    while not stop.is_set():
        snap = ledger.snapshot(NODE)
        assert snap is not None
        seen += 1
        leased = sum(x.tokens for x in snap.leases)
        if not 0 <= snap.reserved <= CAPACITY or leased != snap.reserved:
            bad.append(f"reserved {snap.reserved}, leases hold {leased}, capacity {CAPACITY}")
    ledger.close()
    results.put((seen, bad))


@pytest.mark.slow
def test_concurrent_holders_never_overcommit_and_end_at_zero(
    ledger_redis_url: str, redis_namespace: str
) -> None:
    ledger = Ledger.from_url(ledger_redis_url, redis_namespace, POLICY)
    ledger.rebuild([NodePool(NODE, CAPACITY, 16)], [], epoch=1)
    ctx = mp.get_context("fork")
    holder_results: Queue[tuple[int, int, int, list[str]]] = ctx.Queue()
    monitor_results: Queue[tuple[int, list[str]]] = ctx.Queue()
    stop = ctx.Event()
    monitor = ctx.Process(
        target=_monitor, args=(ledger_redis_url, redis_namespace, stop, monitor_results)
    )
    holders = [
        ctx.Process(target=_holder, args=(ledger_redis_url, redis_namespace, seed, holder_results))
        for seed in range(PROCESSES)
    ]
    monitor.start()
    for p in holders:
        p.start()
    outcomes = [holder_results.get(timeout=240) for _ in holders]
    stop.set()
    seen, monitor_bad = monitor_results.get(timeout=30)
    for p in [*holders, monitor]:
        p.join(timeout=30)
        assert p.exitcode == 0

    assert monitor_bad == []
    assert seen > 10
    assert [b for *_, b in outcomes if b] == []
    admitted = sum(o[0] for o in outcomes)
    assert admitted + sum(o[1] for o in outcomes) == PROCESSES * PAIRS
    assert admitted > PAIRS  # the pool was actually shared, not just refused
    assert sum(o[2] for o in outcomes) > 0  # interactive did preempt batch
    snap = ledger.snapshot(NODE)
    assert snap is not None
    assert (snap.reserved, snap.interactive_in_use, snap.batch_in_use) == (0, 0, 0)
    assert snap.leases == ()
    ledger.close()
