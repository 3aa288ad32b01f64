"""Wake a summarisation job's reduce driver when items of its batches end, on the node that
ran them, instead of leaving them to the next maintenance tick.

A document's reduce step can be made only once its chunks' summaries are in, and the
driver (:mod:`backfill.summarize.driver`) otherwise runs once per maintenance tick (5 s by
default): every level of a document's reduce tree, and the job's last step, waited up to a
tick. The node's result writer tells :class:`SummaryWaker` which batches the results it
just made durable belong to; the waker, on a thread of its own (the dispatcher's event loop
never waits on it), finds the summary jobs that made them and drives each one round under
the job's driver lock. A round is what a tick would do, keyed and guarded the same way, so
a wake and a tick (or two nodes' wakes) on one job lose and double nothing: the one that
finds the lock taken comes back a moment later, so results committed while another round
ran are not left for the next tick. A round that fails, for any reason, is logged and left to
the tick; the thread goes on waking the jobs of later results.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable

from backfill.config import Settings
from backfill.errors import BackfillError
from backfill.store.protocol import SummaryStore
from backfill.summarize import driver
from backfill.summarize.job_plan import round_gap

log = logging.getLogger("backfill.summarize")

KNOWN_BATCHES = 4096
"""Batches whose owner (a summary job or none) is remembered; oldest forgotten first."""
LOCKED_RETRY_S = 0.2
"""How soon a job whose driver lock was held is tried again."""
ROUND_GAP_S = 0.5
"""The least time between two rounds of wakes. Results are stored a few at a time, many times
a second while a job's map wave runs; a round right after each kept the waker's thread (and
Postgres) busy on the engine's own cores for what one round a moment later does at once: the
results stored meanwhile are all taken by the next round. A reduce level waits at most this
much longer (the maintenance tick's 5 s was the bound before wakes); a job with many steps
still waiting to start, four times this (``job_plan.round_gap``)."""


class SummaryWaker:
    """Drives the summary jobs whose batches' items ended, one round each, on its thread."""

    def __init__(
        self, repo: SummaryStore, settings: Settings, *, round_gap_s: float = ROUND_GAP_S
    ) -> None:
        self._repo, self._settings = repo, settings
        self._round_gap_s = round_gap_s
        self._stopping = threading.Event()
        self._owners: OrderedDict[str, str | None] = OrderedDict()
        self._batches: set[str] = set()
        self._jobs: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="summary-wake", daemon=True)
        self.rounds = 0
        """Job rounds driven (for tests and logs)."""
        self.last_gap_s = round_gap_s
        """The gap after the last round (for tests and logs)."""

    def start(self) -> SummaryWaker:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped = True
        self._stopping.set()
        self._wake.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout_s)

    def items_ended(self, batch_ids: Iterable[str]) -> None:
        """Items of ``batch_ids`` ended and their results are stored: never blocks."""
        with self._lock:
            self._batches.update(batch_ids)
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped:
            self._wake.wait()
            self._wake.clear()
            if self._stopped:
                return
            gap = self._round_gap_s
            try:
                gap = self._drive(self._due_jobs())
            except BackfillError as exc:  # Postgres away, say: the tick still drives them
                log.warning("summary jobs not woken: %s", exc)
            except Exception:  # a fault of ours: say it, and keep waking the next ones
                log.exception("summary jobs not woken")
            self.last_gap_s = gap
            self._stopping.wait(gap)  # what ends meanwhile: the next round's

    def _due_jobs(self) -> set[str]:
        with self._lock:
            batches, self._batches = self._batches, set()
            jobs, self._jobs = self._jobs, set()
        unknown = [b for b in batches if b not in self._owners]
        if unknown:
            found = self._repo.summary_batches.summary_jobs_of_batches(unknown)
            for batch in unknown:
                self._owners[batch] = found.get(batch)
            while len(self._owners) > KNOWN_BATCHES:
                self._owners.popitem(last=False)
        jobs.update(job for b in batches if (job := self._owners.get(b)) is not None)
        return jobs

    def _drive(self, jobs: set[str]) -> float:
        """One round of each job; the gap before the next round (the shortest any job
        driven asks for: ``job_plan.round_gap``)."""
        gaps: list[float] = []
        for job_id in sorted(jobs):
            report = driver.DriverReport()
            gaps.append(self._round_gap_s)  # a job not driven now: the short gap
            try:
                if driver.drive_now(self._repo, self._settings, job_id, report=report):
                    self.rounds += 1
                    gaps[-1] = round_gap(self._round_gap_s, report.waiting_steps)
                    continue
            except BackfillError as exc:
                log.warning("summary job %s not woken: %s", job_id, exc)
                continue
            except Exception:  # one job's fault leaves the others woken
                log.exception("summary job %s not woken", job_id)
                continue
            # Another process drives it now, maybe from before these results: once more.
            with self._lock:
                self._jobs.add(job_id)
            retry = threading.Timer(LOCKED_RETRY_S, self._wake.set)
            retry.daemon = True
            retry.start()
        return min(gaps, default=self._round_gap_s)
