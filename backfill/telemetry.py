"""Prometheus metrics computed at scrape time from Postgres and the ledger.

Nothing here runs on the request path: a scrape asks Postgres for the per-job counters, the
jobs per state and the items that finished since the previous scrape (an index range), and
asks the ledger for each node's pool snapshot and its monotonic denial/preemption counts. So
the figures are the same whichever API process is scraped, and no worker has to push them.

The token histograms are the one stateful part: each scrape adds the items that succeeded
since the last one to counts kept in this process, so they start from the items of the last
``lookback_s`` when the process starts (a counter reset, as Prometheus expects of a
restart). Every API process keeps its own: scrape one, or do not sum them.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from backfill.engine_scheduler import read_scheduler
from backfill.ledger import LedgerReadings
from backfill.states import ITEM_TERMINAL, ItemState, JobState
from backfill.store import QueueStats
from backfill.work_signals import read_budget

log = logging.getLogger(__name__)

TOKEN_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)

UNFINISHED_STATES = tuple(s for s in ItemState if s not in ITEM_TERMINAL)


class _NoLedger(Exception):
    """The collector was built without a ledger: its figures are absent, not failing."""


class _TokenHistograms:
    """Cumulative prompt/output token histograms of succeeded items, fed per scrape."""

    def __init__(self, bounds: Sequence[int]) -> None:
        self.bounds = list(bounds)
        self.since: datetime | None = None
        self.count = 0
        self.sums = {"prompt": 0, "output": 0}
        self.le = {"prompt": [0] * len(self.bounds), "output": [0] * len(self.bounds)}
        self.lock = threading.Lock()

    def advance(self, repo: QueueStats, lookback_s: float, lag_s: float) -> None:
        # One scrape at a time: two concurrent ones would count the same window twice.
        with self.lock:
            stats = repo.stats.finished_token_stats(
                self.since, self.bounds, lookback_s=lookback_s, lag_s=lag_s
            )
            if self.since is not None and stats.until <= self.since:
                return
            self.since = stats.until
            self.count += stats.count
            self.sums["prompt"] += stats.prompt_sum
            self.sums["output"] += stats.output_sum
            for i in range(len(self.bounds)):
                self.le["prompt"][i] += stats.prompt_le[i]
                self.le["output"][i] += stats.output_le[i]

    def families(self) -> Iterator[Any]:
        with self.lock:
            for kind in ("prompt", "output"):
                buckets = [
                    (str(float(b)), n) for b, n in zip(self.bounds, self.le[kind], strict=True)
                ]
                buckets.append(("+Inf", self.count))
                yield HistogramMetricFamily(
                    f"backfill_{kind}_tokens",
                    f"{kind.capitalize()} tokens of succeeded batch items.",
                    buckets=buckets,
                    sum_value=self.sums[kind],
                )


class BackfillCollector:
    """A ``prometheus_client`` collector over one deployment's Postgres and ledger."""

    def __init__(
        self,
        repo: QueueStats,
        ledger: LedgerReadings | None,
        *,
        useful_window_s: float = 60.0,
        lookback_s: float = 600.0,
        lag_s: float = 2.0,
        token_buckets: Sequence[int] = TOKEN_BUCKETS,
    ) -> None:
        self.repo = repo
        self.ledger = ledger
        self.useful_window_s = useful_window_s
        self.lookback_s = lookback_s
        self.lag_s = lag_s
        self._histograms = _TokenHistograms(token_buckets)

    def describe(self) -> list[Any]:
        # Registering must not query anything; the families are only known at scrape time.
        return []

    def collect(self) -> Iterator[Any]:
        up = GaugeMetricFamily(
            "backfill_metrics_source_up",
            "Whether this scrape could read the source (1) or not (0).",
            labels=["source"],
        )
        # One family for both classes (a name may appear once per exposition): batch
        # counts come from Postgres, interactive ones from the ledger's live leases.
        items = GaugeMetricFamily(
            "backfill_items",
            "Unfinished work by service class and state (interactive requests are never "
            "queued: the gateway admits or refuses them at once).",
            labels=["class", "state"],
        )
        found = []
        for source, section in (("postgres", self._postgres), ("ledger", self._ledger)):
            families, ok = _guarded(source, functools.partial(section, items))
            found.extend(families)
            up.add_metric([source], 1.0 if ok else 0.0)
        yield items
        yield from found
        yield up

    # -- Postgres

    def _postgres(self, by_state: Any) -> list[Any]:
        repo = self.repo
        items = repo.stats.item_state_totals()
        jobs = repo.stats.job_state_totals()
        for state in UNFINISHED_STATES:
            by_state.add_metric(["batch", state.value], items[state])
        finished = CounterMetricFamily(
            "backfill_items_finished",
            "Batch items that reached a final state.",
            labels=["state"],
        )
        for state in sorted(ITEM_TERMINAL):
            finished.add_metric([state.value], items[state])

        job_gauge = GaugeMetricFamily("backfill_jobs", "Batch jobs by state.", labels=["state"])
        for job_state in JobState:
            job_gauge.add_metric([job_state.value], jobs[job_state])

        misses = CounterMetricFamily(
            "backfill_deadline_misses",
            "Work that did not finish before its deadline: expired items and expired jobs.",
            labels=["scope"],
        )
        misses.add_metric(["item"], items[ItemState.EXPIRED])
        misses.add_metric(["job"], jobs[JobState.EXPIRED])

        queued = GaugeMetricFamily(
            "backfill_queued_tokens",
            "Worst-case tokens (prompt + max output) of unfinished work, by service class.",
            labels=["class"],
        )
        queued.add_metric(["batch"], repo.stats.backlog_tokens())
        # The gateway admits or refuses interactive requests at once: none wait in a queue.
        queued.add_metric(["interactive"], 0)

        useful = GaugeMetricFamily(
            "backfill_useful_tokens_per_second",
            "Output tokens of items that succeeded over the last window, per second "
            "(work later thrown away by preemption or failure is not counted).",
            labels=["window_s"],
        )
        window = self.useful_window_s
        done = repo.stats.output_tokens_finished_within(window)
        useful.add_metric([f"{window:g}"], done / window)

        waiting, oldest_s = repo.ingest_queue.ingest_backlog()
        ingest = GaugeMetricFamily(
            "backfill_ingest_queue",
            "Batch creates whose file waits for an ingest process (or is being ingested).",
        )
        ingest.add_metric([], waiting)
        ingest_age = GaugeMetricFamily(
            "backfill_ingest_queue_oldest_seconds",
            "How long the oldest create waiting for an ingest process has waited (0: none).",
        )
        ingest_age.add_metric([], oldest_s)

        self._histograms.advance(repo, self.lookback_s, self.lag_s)
        return [
            finished,
            job_gauge,
            misses,
            queued,
            useful,
            ingest,
            ingest_age,
            *self._histograms.families(),
        ]

    # -- ledger

    def _ledger(self, by_state: Any) -> list[Any]:
        nodes = {n.name: n for n in self.repo.nodes.nodes()}
        families = _ledger_families()
        if self.ledger is None:
            raise _NoLedger
        names = sorted(set(nodes) | set(self.ledger.nodes()))
        interactive_running = 0
        for name in names:
            snap = self.ledger.snapshot(name)
            if snap is None:
                record = nodes[name]
                families.kv.add_metric([name, "capacity"], record.capacity_tokens)
                families.kv.add_metric(
                    [name, "interactive_reserve"], record.interactive_reserve_tokens
                )
                continue
            figures = {
                "capacity": snap.capacity_tokens,
                "interactive_reserve": snap.reserve_tokens,
                "interactive_reserved": snap.interactive_in_use,
                "batch_reserved": snap.batch_in_use,
                "engine_observed_non_batch": snap.observed_non_batch,
                "slack": snap.slack,
            }
            for kind, value in figures.items():
                families.kv.add_metric([name, kind], value)
            per_class = {"interactive": 0, "batch": 0}
            for lease in snap.leases:
                per_class[str(lease.service_class)] += 1
            for service_class, n in per_class.items():
                families.leases.add_metric([name, service_class], n)
            interactive_running += per_class["interactive"]
            counts = self.ledger.counters(name)
            for (service_class, reason), n in sorted(counts.denials.items()):
                families.denials.add_metric([name, service_class, reason], n)
            families.preemptions.add_metric([name], counts.preemptions)
            families.recounts.add_metric([name], counts.owners_recounted)
            families.over_reserved.add_metric([name], counts.over_reserved_samples)
            families.over_reserved_now.add_metric([name], counts.over_reserved_tokens)
            view = read_budget(self.ledger.client, self.ledger.keys, name)
            if view is not None:
                for kind, value in (
                    ("max_seqs", view.max_seqs),
                    ("max_prefill_tokens", view.max_prefill_tokens),
                    ("hold", int(view.hold)),
                    ("in_flight", view.in_flight),
                    ("prefill_tokens", view.prefill_tokens),
                ):
                    families.budget.add_metric([name, kind], value)
                families.budget_change.add_metric([name, view.code], view.changed_at_s)
            engine_scheduler = read_scheduler(self.ledger.client, self.ledger.keys, name)
            if engine_scheduler is not None:
                families.mismatch.add_metric([name], 0 if engine_scheduler.agrees else 1)
        by_state.add_metric(["interactive", ItemState.QUEUED.value], 0)
        by_state.add_metric(["interactive", ItemState.RUNNING.value], interactive_running)
        return families.all()


@dataclass(frozen=True, slots=True)
class _LedgerFamilies:
    """The ledger section's metric families, filled node by node."""

    kv: GaugeMetricFamily
    leases: GaugeMetricFamily
    denials: CounterMetricFamily
    preemptions: CounterMetricFamily
    recounts: CounterMetricFamily
    over_reserved: CounterMetricFamily
    over_reserved_now: GaugeMetricFamily
    budget: GaugeMetricFamily
    budget_change: GaugeMetricFamily
    mismatch: GaugeMetricFamily

    def all(self) -> list[Any]:
        return [
            self.kv,
            self.leases,
            self.denials,
            self.preemptions,
            self.recounts,
            self.over_reserved,
            self.over_reserved_now,
            self.budget,
            self.budget_change,
            self.mismatch,
        ]


def _ledger_families() -> _LedgerFamilies:
    kv = GaugeMetricFamily(
        "backfill_kv_tokens",
        "A node's KV pool in tokens: capacity (measured), the interactive reserve, the "
        "tokens reserved per class, what the engine reports non-batch work holds, and "
        "the batch slack.",
        labels=["node", "kind"],
    )
    leases = GaugeMetricFamily(
        "backfill_leases", "Live ledger leases by node and class.", labels=["node", "class"]
    )
    denials = CounterMetricFamily(
        "backfill_allocation_denials",
        "Reservations the ledger refused, by node, class and reason.",
        labels=["node", "class", "reason"],
    )
    preemptions = CounterMetricFamily(
        "backfill_preemptions",
        "Batch leases preempted to make room for interactive work.",
        labels=["node"],
    )
    recounts = CounterMetricFamily(
        "backfill_interactive_owner_recounts",
        "Owners whose interactive tokens on a node (what a tenant's share is checked "
        "against) the periodic reap found off the live leases and put right; stays 0 "
        "while every process runs the same ledger scripts.",
        labels=["node"],
    )
    over_reserved = CounterMetricFamily(
        "backfill_kv_allocated_over_reserved_samples",
        "Samples of a node's engine in which it held more KV tokens than the ledger "
        "reserved on the node (the invariant, checked physically; stays 0).",
        labels=["node"],
    )
    over_reserved_now = GaugeMetricFamily(
        "backfill_kv_allocated_over_reserved_tokens",
        "KV tokens a node's engine held above the ledger's reservations at the last "
        "sample (0 while the invariant holds).",
        labels=["node"],
    )
    budget = GaugeMetricFamily(
        "backfill_work_budget",
        "A node's batch work budget (max_seqs, max_prefill_tokens, hold) and what batch "
        "uses of it (in_flight, prefill_tokens), as its worker last published them.",
        labels=["node", "kind"],
    )
    budget_change = GaugeMetricFamily(
        "backfill_work_budget_last_change_seconds",
        "When a node's work budget last changed (Unix time), labelled with why.",
        labels=["node", "reason"],
    )
    mismatch = GaugeMetricFamily(
        "backfill_engine_scheduler_priority_mismatch",
        "1 where a node's engine scheduler takes batch at another priority than its "
        "worker sends (the engine then does not pause that batch; the worker's work "
        "budget keeps preempting for interactive TTFT).",
        labels=["node"],
    )
    return _LedgerFamilies(
        kv,
        leases,
        denials,
        preemptions,
        recounts,
        over_reserved,
        over_reserved_now,
        budget,
        budget_change,
        mismatch,
    )


def _guarded(source: str, section: Callable[[], list[Any]]) -> tuple[list[Any], bool]:
    # A scrape answers with what it can read: Postgres down must not hide the ledger's
    # figures, nor the reverse, and /metrics must never answer 500.
    try:
        return section(), True
    except _NoLedger:
        return [], False
    except Exception:  # the drivers raise many types; each is logged once per scrape
        log.warning("metrics: could not read %s", source, exc_info=True)
        return [], False
