"""Scenario 3: 200 items preempted and resumed under a repeating interactive burst.

An interactive reservation that needs more than the pool has free takes room from running
batch leases (the ledger's preemption), again and again. Every item must still complete
exactly once, resume from its partial output (its answer has exactly ``max_tokens`` tokens),
be preempted no more than ``max_preemptions_per_item`` times, and not loop between workers;
and the pool invariants hold at every sampled moment.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from backfill.ledger import Lease, Ledger
from backfill.states import ItemState
from tests.reliability.conftest import CAPACITY, LEASE_TTL_S, REAPER_S
from tests.reliability.support import Deployment, maintenance, report, sampling
from tests.reliability.test_worker_kill import deployment_workers

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

ITEMS = 200
MAX_TOKENS = 48
# Most of the pool: admitted only by preempting batch whenever batch holds its whole slack.
BURST_TOKENS = CAPACITY // 2


class Burst(threading.Thread):
    """Interactive load that comes and goes: hold a large reservation, release, pause.

    Each burst waits until batch holds enough of the pool that the reservation must preempt
    it, so the number of preemptions follows the job's length rather than the machine's
    speed (a loaded CI machine ran a third as many timed bursts per item as a quiet one).
    Once items have been preempted, a burst also waits until one of them runs again, so that
    some item is preempted more than once on any machine (a fast CI machine ran the 200 items
    in 6 s, 7 bursts, and preempted none twice), but no longer than ``every_items`` more items
    done since the last burst (an event of the job, not a time: a quiet machine ran the job in
    4 s and, waiting for a second of batch in the way without a break, burst once), nor than
    ``resumed_wait_s`` since the last burst.
    """

    def __init__(
        self,
        ledger: Ledger,
        node: str,
        done: Callable[[], int],
        hold_s: float = 0.2,
        pause_s: float = 0.15,
        resumed_wait_s: float = 1.0,
        every_items: int = 15,
    ):
        super().__init__(name="interactive-burst", daemon=True)
        self.ledger, self.node, self.done = ledger, node, done
        self.hold_s, self.pause_s, self.resumed_wait_s = hold_s, pause_s, resumed_wait_s
        self.every_items = every_items
        self.bursts = 0
        self.admitted = 0
        self.victims = 0
        self.preempted_items: set[str] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        last_burst_at, done_at_last_burst = time.monotonic(), self.done()
        while not self._halt.is_set():
            snap = self.ledger.snapshot(self.node)
            if snap is None or snap.interactive_room >= BURST_TOKENS:
                self._halt.wait(0.02)
                continue
            running = {lease.lease_id: _item_of(lease) for lease in snap.leases}
            resumed = self.preempted_items & set(running.values())
            if (
                self.preempted_items
                and not resumed
                and time.monotonic() - last_burst_at < self.resumed_wait_s
                and self.done() - done_at_last_burst < self.every_items
            ):
                self._halt.wait(0.02)
                continue
            last_burst_at, done_at_last_burst = time.monotonic(), self.done()
            lease = self.ledger.reserve(self.node, "interactive", BURST_TOKENS - 256, 256)
            self.bursts += 1
            if isinstance(lease, Lease):
                self.admitted += 1
                self.victims += len(lease.preempted)
                self.preempted_items.update(
                    item for v in lease.preempted if (item := running.get(v)) is not None
                )
                self._halt.wait(self.hold_s)
                self.ledger.release(lease)
            self._halt.wait(self.pause_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def _item_of(lease: Lease) -> str | None:
    """The item a batch lease runs: a worker's owner is ``node/item/attempt``."""
    parts = lease.owner.split("/")
    return parts[1] if lease.service_class == "batch" and len(parts) == 3 else None


def test_items_preempted_again_and_again_complete_once_within_the_cap(
    deployment: Deployment, workdir: Path
) -> None:
    d = deployment
    cap = d.settings.max_preemptions_per_item
    job = d.submit(ITEMS, max_tokens=MAX_TOKENS, tag="preempt")
    workers = deployment_workers(d, workdir, 2)
    burst = Burst(d.ledger, d.node, lambda: d.done(job))
    try:
        with maintenance(d, REAPER_S), sampling(d.ledger, d.node, d.settings) as samples:
            for w in workers:
                w.start()
            for w in workers:
                w.wait_ready()
            started = time.monotonic()
            burst.start()
            d.wait(lambda: d.done(job) == ITEMS, 400, "every item")
            burst.stop()
            elapsed = time.monotonic() - started
            d.assert_no_leak(timeout=LEASE_TTL_S + 5)
    finally:
        burst.stop()
        for w in workers:
            w.close()
    once = d.assert_exactly_once(job, ITEMS)
    items = d.repo.items.items(job, limit=ITEMS)
    preemptions = [i.preemptions for i in items]
    outcomes = d.attempt_outcomes(job)
    attempts = [len(v) for v in outcomes.values()]
    lengths = {
        i.id: (json.loads(i.result or "{}").get("usage", {}).get("completion_tokens"), i.attempt)
        for i in items
    }
    wrong_length = {k: v for k, v in lengths.items() if v[0] != MAX_TOKENS}
    report(
        "3 preempt and resume under interactive bursts",
        items=ITEMS,
        bursts=burst.bursts,
        bursts_admitted=burst.admitted,
        preemptions_total=sum(preemptions),
        preempted_items=sum(1 for p in preemptions if p),
        max_preemptions_per_item=max(preemptions),
        cap=cap,
        max_attempts_per_item=max(attempts),
        wrong_length_results=len(wrong_length),
        lost=once["lost"],
        doubled=once["doubled"],
        ledger_samples=samples.samples,
        peak_reserved=samples.peak_reserved,
        capacity=samples.capacity,
        violations=len(samples.violations),
        job_s=round(elapsed, 1),
    )
    assert sum(preemptions) >= ITEMS // 5, "the bursts preempted too little to test anything"
    assert max(preemptions) >= 2, "no item was preempted more than once"
    assert max(preemptions) <= cap
    if wrong_length:
        history = d.sql(
            "SELECT item_id, attempt, outcome, output_tokens, detail FROM attempts "
            "WHERE item_id = ANY(:ids) ORDER BY item_id, attempt",
            ids=list(wrong_length),
        )
        raise AssertionError(f"not resumed to max_tokens: {wrong_length}; attempts {history}")
    # No delivery loop: an item is claimed a bounded number of times (its preemptions, a few
    # deferrals while the burst holds the pool, and its final run).
    assert max(attempts) <= cap + 12, max(attempts)
    assert not samples.violations, samples.violations[:5]
    assert d.counts(job) == {ItemState.SUCCEEDED: ITEMS}
