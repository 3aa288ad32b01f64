"""What the reliability scenarios share: a deployment over one engine, the maintenance loop,
a ledger sampler that checks the pool invariants while a scenario runs, exactly-once checks
over the attempts table, and the figures each scenario prints (and records for
``bench/RESULTS.md``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import text

from backfill.config import Settings
from backfill.errors import BackfillError
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy, tick
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository
from tests.reliability.services import wait_until

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ROOT / "bench" / "out" / "reliability.json"


def report(scenario: str, **figures: Any) -> None:
    """Print one summary line for the scenario and keep its figures in bench/out/."""
    line = ", ".join(f"{k}={v}" for k, v in figures.items())
    print(f"\n[reliability] {scenario}: {line}", flush=True)
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    try:
        known = json.loads(FIGURES.read_text())
    except (OSError, ValueError):
        known = {}
    known[scenario] = {"at": datetime.now(UTC).isoformat(timespec="seconds"), **figures}
    FIGURES.write_text(json.dumps(known, indent=2, sort_keys=True) + "\n")


def completion_body(i: int, max_tokens: int, tag: str = "", **extra: Any) -> str:
    body = {
        "model": "tiny",
        "prompt": f"{tag} document {i}: the fox",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }
    return json.dumps(body)


@dataclass
class Deployment:
    """One test deployment: its settings, Postgres and ledger, and the engine's URL."""

    settings: Settings
    repo: Repository
    ledger: Ledger
    engine_url: str
    node: str = "n1"

    def submit(
        self,
        n: int,
        *,
        max_tokens: int = 8,
        deadline_s: float = 3600,
        tag: str = "",
        bodies: dict[int, str] | None = None,
    ) -> str:
        """A job of ``n`` completions items, in progress; ``bodies`` replaces some lines."""
        tenant = self.repo.tenants.create_tenant(f"t-{time.monotonic_ns()}")
        f = self.repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
        job = self.repo.jobs.create_job(
            tenant.id,
            f.id,
            "/v1/completions",
            "1h",
            datetime.now(UTC) + timedelta(seconds=deadline_s),
        )
        bodies = bodies or {}
        items = [
            NewItem(i, f"req-{i}", bodies.get(i) or completion_body(i, max_tokens, tag), max_tokens)
            for i in range(n)
        ]
        self.repo.ingest.insert_items(job.id, items)
        self.repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        return job.id

    def counts(self, job_id: str) -> dict[ItemState, int]:
        return self.repo.stats.counted_states(job_id)

    def done(self, job_id: str) -> int:
        c = self.counts(job_id)
        return sum(c.get(s, 0) for s in (ItemState.SUCCEEDED, ItemState.FAILED))

    def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> float:
        return wait_until(cond, timeout, what, poll=0.1)

    def batch_in_use(self) -> int:
        snap = self.ledger.snapshot(self.node)
        return 0 if snap is None else snap.batch_in_use

    def sql(self, query: str, **params: Any) -> list[Any]:
        with self.repo.engine.connect() as conn:
            return list(conn.execute(text(query), params).all())

    def attempt_outcomes(self, job_id: str) -> dict[int, list[str | None]]:
        """Each item's attempt outcomes, in attempt order."""
        rows = self.sql(
            "SELECT i.id, a.outcome FROM items i LEFT JOIN attempts a ON a.item_id = i.id "
            "WHERE i.job_id = :j ORDER BY i.id, a.attempt",
            j=job_id,
        )
        out: dict[int, list[str | None]] = {}
        for item_id, outcome in rows:
            out.setdefault(item_id, [])
            if outcome is not None or out[item_id]:
                out[item_id].append(outcome)
        return out

    def assert_exactly_once(self, job_id: str, n: int) -> dict[str, int]:
        """Every item succeeded once: one succeeded attempt, one result; none lost."""
        counts = self.counts(job_id)
        succeeded_attempts = self.sql(
            "SELECT i.id, count(a.id) FILTER (WHERE a.outcome = 'succeeded') "
            "FROM items i LEFT JOIN attempts a ON a.item_id = i.id "
            "WHERE i.job_id = :j GROUP BY i.id",
            j=job_id,
        )
        per_item = [int(r[1]) for r in succeeded_attempts]
        lost = sum(1 for c in per_item if c == 0)
        doubled = sum(1 for c in per_item if c > 1)
        results = self.sql(
            "SELECT count(*) FROM items WHERE job_id = :j AND state = 'succeeded' "
            "AND result IS NOT NULL",
            j=job_id,
        )[0][0]
        assert len(per_item) == n, f"{len(per_item)} items, expected {n}"
        assert lost == 0, f"{lost} items without a succeeded attempt; states {counts}"
        assert doubled == 0, f"{doubled} items with two succeeded attempts"
        assert results == n, f"{results} results for {n} items"
        return {"lost": lost, "doubled": doubled}

    def assert_no_leak(self, timeout: float = 30) -> None:
        """No batch tokens reserved and no live lease left on the node."""

        def clean() -> bool:
            snap = self.ledger.snapshot(self.node)
            return snap is not None and snap.batch_in_use == 0 and not snap.leases

        self.wait(clean, timeout, "the node's batch leases to be released")


@dataclass
class LedgerSamples:
    """Figures of the pool invariants sampled while a scenario ran."""

    samples: int = 0
    peak_batch: int = 0
    peak_reserved: int = 0
    batch_limit: int = 0
    capacity: int = 0
    violations: list[str] = field(default_factory=list)
    unavailable: int = 0


class LedgerSampler(threading.Thread):
    """Samples a node's pool every ``interval`` seconds: batch in use never above capacity
    minus the interactive reserve, everything reserved never above capacity, and what is
    reserved always the sum of the live leases."""

    def __init__(self, ledger: Ledger, node: str, settings: Settings, interval: float = 0.05):
        super().__init__(name="ledger-sampler", daemon=True)
        self.ledger = ledger
        self.node = node
        self.policy = pool_policy(settings)
        self.interval = interval
        self.figures = LedgerSamples()
        self._halt = threading.Event()

    def run(self) -> None:
        f = self.figures
        while not self._halt.wait(self.interval):
            try:
                snap = self.ledger.snapshot(self.node)
            except BackfillError:
                f.unavailable += 1
                continue
            if snap is None or not snap.ready:
                continue
            f.samples += 1
            f.capacity = snap.capacity_tokens
            f.batch_limit = snap.capacity_tokens - self.policy.reserve_tokens(snap.capacity_tokens)
            f.peak_batch = max(f.peak_batch, snap.batch_in_use)
            f.peak_reserved = max(f.peak_reserved, snap.reserved)
            leased = sum(lease.tokens for lease in snap.leases)
            if snap.batch_in_use > f.batch_limit:
                f.violations.append(f"batch {snap.batch_in_use} > limit {f.batch_limit}")
            if snap.reserved > snap.capacity_tokens:
                f.violations.append(f"reserved {snap.reserved} > capacity {snap.capacity_tokens}")
            if leased != snap.reserved:
                f.violations.append(f"leases hold {leased} but reserved is {snap.reserved}")

    def stop(self) -> LedgerSamples:
        self._halt.set()
        self.join(10)
        return self.figures


@contextmanager
def sampling(ledger: Ledger, node: str, settings: Settings) -> Iterator[LedgerSamples]:
    sampler = LedgerSampler(ledger, node, settings)
    sampler.start()
    try:
        yield sampler.figures
    finally:
        sampler.stop()


class Maintenance(threading.Thread):
    """Beat's job: a maintenance tick every ``interval`` seconds; store outages are logged
    and retried, as the Celery task would be on its next schedule."""

    def __init__(self, repo: Repository, ledger: Ledger, settings: Settings, interval: float):
        super().__init__(name="maintenance", daemon=True)
        self.repo, self.ledger, self.settings = repo, ledger, settings
        self.interval = interval
        self.ticks = 0
        self.failed_ticks = 0
        self.rebuilds = 0
        self.longest_s = 0.0
        self.longest_gap_s = 0.0
        """The longest time from one tick's start to the next's: the interval, the tick's own
        run time and however late this thread woke on a busy machine."""
        self._halt = threading.Event()

    def run(self) -> None:
        previous = time.monotonic()
        while not self._halt.wait(self.interval):
            began = time.monotonic()
            self.longest_gap_s = max(self.longest_gap_s, began - previous)
            previous = began
            try:
                report = tick(self.repo, self.ledger, self.settings)
            except BackfillError:
                self.failed_ticks += 1
                continue
            finally:
                self.longest_s = max(self.longest_s, time.monotonic() - began)
            self.ticks += 1
            self.rebuilds += report.rebuilt is not None

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


@contextmanager
def maintenance(d: Deployment, interval: float | None = None) -> Iterator[Maintenance]:
    m = Maintenance(d.repo, d.ledger, d.settings, interval or d.settings.reaper_interval_s)
    m.start()
    try:
        yield m
    finally:
        m.stop()
