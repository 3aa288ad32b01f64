"""Scenario 1: ``backfill worker`` processes killed with SIGKILL at random points, at least 20
times during a job of 1,000 items (on a slow machine, where the job ends before the 20th kill,
further jobs of 500 items keep the workers busy until it comes), some of the kills landing
between an item's durable result and the release of its lease (the worker's
"acknowledgement").

What must hold: no item lost, none with two results (exactly one succeeded attempt each),
every item the dead worker held claimed again within about one lease TTL plus one reaper
interval, the pool invariants at every sampled moment, and no KV tokens left reserved at the
end.
"""

from __future__ import annotations

import random
import signal
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest

from backfill.states import ITEM_TERMINAL, ItemState
from tests.reliability.conftest import HEARTBEAT_S, LEASE_TTL_S, REAPER_S
from tests.reliability.services import WorkerProcess, worker_env
from tests.reliability.support import Deployment, maintenance, report, sampling

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

ITEMS = 1000
TOP_UP = 500
KILLS = 20
WORKERS = 3
MAX_TOKENS = 8
# The reaper requeues a dead worker's item within a TTL (from its last heartbeat) plus the gap
# to the next tick's start (an interval, the tick before's run time and a late wake-up) plus
# that tick's run time; both are measured, and the tolerance covers the rest (the Postgres
# round trips around the kill). A live worker then claims it as soon as its slack has room: on
# this shared 2-core machine, under the load of restarting workers, that has taken up to ~12 s
# more, so the bound on the next start is looser.
TICK_TOLERANCE_S = 0.5
RECLAIM_ALLOWANCE_S = 20.0


@dataclass
class Kill:
    at: datetime
    """Postgres' clock when the victim was killed."""
    active: dict[int, int]
    """(item id -> attempt) of every item held by a live attempt at that moment."""
    window: set[tuple[int, int]] = field(default_factory=set)
    """(item, attempt) whose result was durable and whose lease was not yet released."""
    window_victims: int = 0
    """Of those, how many were the victim's (their lease outlived the kill)."""
    victim_items: dict[int, int] | None = None
    """The victim's share of ``active``: whose claim no survivor's heartbeat extended."""


def deployment_workers(d: Deployment, workdir: Path, n: int) -> list[WorkerProcess]:
    s = d.settings
    env = worker_env(
        s.database_url,
        s.redis_url,
        s.redis_namespace,
        lease_ttl_s=s.lease_ttl_s,
        heartbeat_interval_s=s.heartbeat_interval_s,
        reaper_interval_s=s.reaper_interval_s,
        shutdown_grace_s=s.shutdown_grace_s,
        max_in_flight_per_node=s.max_in_flight_per_node,
    )
    return [WorkerProcess(d.node, d.engine_url, env, workdir / f"worker-{i}.log") for i in range(n)]


def _finished_but_leased(d: Deployment) -> dict[tuple[int, int], str]:
    """Leases still held for attempts whose result is already durable in Postgres."""
    snap = d.ledger.snapshot(d.node)
    if snap is None:
        return {}
    owners: dict[tuple[int, int], str] = {}
    for lease in snap.leases:
        parts = lease.owner.split("/")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            owners[(int(parts[1]), int(parts[2]))] = lease.lease_id
    if not owners:
        return {}
    rows = d.sql(
        "SELECT id, attempt FROM items WHERE id = ANY(:ids) AND state = ANY(:done)",
        ids=[k[0] for k in owners],
        done=[s.value for s in ITEM_TERMINAL],
    )
    return {(r[0], r[1]): owners[(r[0], r[1])] for r in rows if (r[0], r[1]) in owners}


def _kill(d: Deployment, jobs: list[str], victim: WorkerProcess, probes: int) -> Kill:
    """Freeze the victim, look, and kill it; with ``probes`` > 1, look up to that many times
    for a moment when a result is durable but its lease not yet released (the survivors run
    on: a window lease of theirs is released at once, which tells it from the victim's)."""
    window: dict[tuple[int, int], str] = {}
    for probe in range(probes):
        victim.signal(signal.SIGSTOP)
        window = _finished_but_leased(d)
        if window or probe == probes - 1:
            break
        victim.signal(signal.SIGCONT)
        time.sleep(0.005)
    at = d.sql("SELECT clock_timestamp()")[0][0]
    active = d.sql(
        "SELECT id, attempt FROM items WHERE job_id = ANY(:jobs) "
        "AND state IN ('reserved', 'running')",
        jobs=jobs,
    )
    victim.kill()
    kill = Kill(at, {r[0]: r[1] for r in active}, set(window))
    if window:
        # A survivor releases its own at once; what is still leased a moment later was the
        # victim's: killed after its result was durable and before its lease went back.
        time.sleep(0.3)
        still = set(_finished_but_leased(d))
        kill.window_victims = len(kill.window & still)
    return kill


def _classify(d: Deployment, kill: Kill) -> None:
    """Tell the victim's items from the survivors': more than a heartbeat after the kill, a
    survivor's claims were extended past the kill's time plus a TTL; the victim's were not."""
    rows = d.sql(
        "SELECT v.id, v.a FROM unnest(CAST(:ids AS bigint[]), CAST(:att AS int[])) AS v(id, a) "
        "JOIN items i ON i.id = v.id WHERE NOT (i.attempt = v.a "
        "AND i.state IN ('reserved', 'running') "
        "AND i.lease_expires_at > CAST(:at AS timestamptz) + make_interval(secs => :ttl))",
        ids=list(kill.active),
        att=list(kill.active.values()),
        at=kill.at,
        ttl=LEASE_TTL_S,
    )
    kill.victim_items = {r[0]: r[1] for r in rows}


def _classify_due(d: Deployment, kills: list[Kill], kill_times: list[float], wait: bool) -> None:
    settle_s = 2 * HEARTBEAT_S
    for kill, at in zip(kills, kill_times, strict=True):
        if kill.victim_items is not None:
            continue
        left = at + settle_s - time.monotonic()
        if left > 0 and not wait:
            continue
        time.sleep(max(left, 0))
        _classify(d, kill)


def _reclaim_delays(d: Deployment, kills: list[Kill]) -> tuple[list[float], list[float]]:
    """For each item the victim held (its attempt was then reaped as lost): seconds from the
    kill to the reaper's requeue, and to the item's next attempt."""
    requeued: list[float] = []
    reclaimed: list[float] = []
    seen: set[tuple[int, int]] = set()
    for kill in kills:
        held = kill.victim_items or {}
        if not held:
            continue
        rows = d.sql(
            "SELECT v.id, lost.ended_at, (SELECT min(a.started_at) FROM attempts a "
            "  WHERE a.item_id = v.id AND a.attempt > v.a) "
            "FROM unnest(CAST(:ids AS bigint[]), CAST(:att AS int[])) AS v(id, a) "
            "JOIN attempts lost ON lost.item_id = v.id AND lost.attempt = v.a "
            "AND lost.outcome = 'lost'",
            ids=list(held),
            att=list(held.values()),
        )
        for item_id, ended, next_start in rows:
            if (item_id, held[item_id]) in seen:
                continue  # the earliest kill it was left unheld after is the one that hit it
            seen.add((item_id, held[item_id]))
            requeued.append((ended - kill.at).total_seconds())
            if next_start is not None:
                reclaimed.append((next_start - kill.at).total_seconds())
    return requeued, reclaimed


def test_sigkilled_workers_lose_nothing_double_nothing_and_leak_no_tokens(
    deployment: Deployment, workdir: Path
) -> None:
    d = deployment
    rng = random.Random(20261129)
    jobs = {d.submit(ITEMS, max_tokens=MAX_TOKENS, tag="kill"): ITEMS}
    workers = deployment_workers(d, workdir, WORKERS)
    kills: list[Kill] = []
    kill_times: list[float] = []
    started = time.monotonic()
    try:
        with maintenance(d, REAPER_S) as upkeep, sampling(d.ledger, d.node, d.settings) as samples:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready()

            def left() -> int:
                return sum(n - d.done(j) for j, n in jobs.items())

            while len(kills) < KILLS:
                if left() < TOP_UP // 5:  # until the last kill, however fast the items go
                    jobs[d.submit(TOP_UP, max_tokens=MAX_TOKENS, tag=f"kill{len(jobs)}")] = TOP_UP
                _classify_due(d, kills, kill_times, wait=False)
                ready = [w for w in workers if w.is_ready()]
                if len(ready) < 2:
                    time.sleep(0.1)
                    continue
                time.sleep(rng.uniform(0.2, 1.2))
                victim = rng.choice(ready)
                # Every other kill hunts for the moment between result and release.
                kills.append(_kill(d, list(jobs), victim, probes=200 if len(kills) % 2 else 1))
                kill_times.append(time.monotonic())
                victim.start()
            _classify_due(d, kills, kill_times, wait=True)
            d.wait(lambda: left() == 0, 600, "every item to finish")
            elapsed = time.monotonic() - started
            d.assert_no_leak(timeout=LEASE_TTL_S + 10)
    finally:
        for w in workers:
            w.close()
    once = {"lost": 0, "doubled": 0}
    for job, n in jobs.items():
        for k, v in d.assert_exactly_once(job, n).items():
            once[k] += v
    requeued, delays = _reclaim_delays(d, kills)
    bound = LEASE_TTL_S + REAPER_S
    requeue_bound = LEASE_TTL_S + max(REAPER_S, upkeep.longest_gap_s) + upkeep.longest_s
    window_kills = sum(1 for k in kills if k.window_victims)
    report(
        "1 worker kill -9",
        items=sum(jobs.values()),
        kills=len(kills),
        kills_between_result_and_release=window_kills,
        lost=once["lost"],
        doubled=once["doubled"],
        victim_items=len(requeued),
        requeue_max_s=round(max(requeued, default=0.0), 2),
        reclaimed=len(delays),
        reclaim_max_s=round(max(delays, default=0.0), 2),
        reclaim_p50_s=round(statistics.median(delays), 2) if delays else 0.0,
        ttl_plus_reaper_s=bound,
        longest_tick_s=round(upkeep.longest_s, 2),
        longest_tick_gap_s=round(upkeep.longest_gap_s, 2),
        requeue_p50_s=round(statistics.median(requeued), 2) if requeued else 0.0,
        heartbeat_s=HEARTBEAT_S,
        ledger_samples=samples.samples,
        peak_batch_tokens=samples.peak_batch,
        batch_limit=samples.batch_limit,
        violations=len(samples.violations),
        leaked_tokens=d.batch_in_use(),
        job_s=round(elapsed, 1),
    )
    assert window_kills >= 1, "no kill landed between a durable result and its lease release"
    assert delays, "no killed item was claimed again"
    assert len(delays) == len(requeued), "a killed item was requeued but never claimed again"
    # The reaper's bound is the TTL, the gap to the next tick and the run time of the tick that
    # reaps: on a loaded machine one tick has taken 5.5 s (longest_tick_s), and the next tick
    # starts an interval after the last one ended (CI once saw 4.13 s against 3.5 + 0.61 s,
    # 2026-12-03), so both are measured.
    assert max(requeued) <= requeue_bound + TICK_TOLERANCE_S, (
        sorted(requeued)[-5:],
        upkeep.longest_s,
        upkeep.longest_gap_s,
    )
    assert max(delays) <= bound + RECLAIM_ALLOWANCE_S, sorted(delays)[-5:]
    assert not samples.violations, samples.violations[:5]
    for job, n in jobs.items():
        assert d.counts(job) == {ItemState.SUCCEEDED: n}
