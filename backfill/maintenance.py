"""Periodic upkeep that keeps Postgres and the ledger honest (run by Celery beat).

- The ledger is rebuilt from Postgres when Redis lost it; batch admission stays closed until
  then (the ledger's ready marker).
- Items whose attempt stopped heartbeating are requeued, and their leases released, within
  one lease TTL plus one tick: a dead worker is noticed by its silence, not by a broker's
  visibility timeout.
- Items whose worker process died while running them count those deaths against the attempt
  cap: an item that keeps killing its worker fails instead of being retried forever.
- Jobs past their deadline expire; cancelled jobs stop their in-flight items; jobs whose
  items are all finished are finalized with their output and error files; jobs left
  ``validating`` by an API process that died mid-create are moved on.

Every step is idempotent: two ticks running at once, or one repeated, change nothing twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from backfill import finalize
from backfill.config import Settings
from backfill.errors import LedgerError, StaleEpoch
from backfill.ledger import ActiveLease, LeaseRef, MaintenanceLedger, NodePool, RebuildReport
from backfill.policy import ClassLimits, PoolPolicy
from backfill.purge_pace import PurgePace
from backfill.states import ItemState, JobState
from backfill.store import ActiveLeaseRow, MaintenanceStore
from backfill.store.retention import PurgeReport

log = logging.getLogger("backfill.maintenance")


def pool_policy(settings: Settings) -> PoolPolicy:
    """The admission policy every process of a deployment applies, from its settings."""
    return PoolPolicy(
        interactive=ClassLimits(settings.interactive_max_sequence_tokens),
        batch=ClassLimits(settings.batch_max_sequence_tokens),
        interactive_reserve_fraction=settings.interactive_reserve_fraction,
        headroom_tokens=settings.headroom_tokens,
        safety_margin_tokens=settings.safety_margin_tokens,
    )


def purge_pace(settings: Settings) -> PurgePace:
    """How a maintenance tick's retention purge paces itself, from the settings."""
    return PurgePace(
        budget_s=settings.retention_tick_budget_s,
        target_s=settings.retention_chunk_target_s,
        max_rows=settings.retention_chunk_rows,
        rows_per_tick=settings.retention_rows_per_tick,
    )


# How many times a rebuild overtaken by another (a newer epoch in place) starts over.
REBUILD_TRIES = 5


def ensure_ledger(
    repo: MaintenanceStore, ledger: MaintenanceLedger, *, max_preemptions: int
) -> RebuildReport | None:
    """Rebuild the ledger from Postgres if Redis lost it (every node), or the nodes it lost
    (closed for a lost lease, or on a shard that lost its data) while the rest of the fleet
    goes on admitting; None when it was intact.

    Several processes may find it lost at once (workers starting together on one node, the
    maintenance tick): each rebuild takes a new epoch, and one overtaken by a newer one fails
    on the stale epoch. It then starts over from a fresh read (the newer one may have left the
    ledger whole, or the overtaken one may have closed what the newer one had opened)."""
    for attempt in range(1, REBUILD_TRIES + 1):
        try:
            return _ensure_once(repo, ledger, max_preemptions=max_preemptions)
        except StaleEpoch as exc:
            if attempt == REBUILD_TRIES:
                raise
            log.info("ledger: rebuild overtaken by a newer one (%s); reading again", exc)
    raise AssertionError("unreachable")


def _ensure_once(
    repo: MaintenanceStore, ledger: MaintenanceLedger, *, max_preemptions: int
) -> RebuildReport | None:
    only = ledger.incomplete_nodes()
    if only is not None and not only:
        return None
    nodes = [
        NodePool(n.name, n.capacity_tokens, n.block_size, n.interactive_reserve_tokens)
        for n in repo.nodes.nodes()
        if only is None or n.name in only
    ]
    known = {n.name for n in nodes}
    leases = [
        ActiveLease(
            lease_id=row.lease_id,
            node=row.node,
            tokens=row.reservation_tokens,
            fencing_token=row.fencing_token,
            expires_at=row.lease_expires_at,
            owner=f"{row.node}/{row.item_id}/{row.attempt}",
            preemptible=row.preemptions < max_preemptions,
            generated_tokens=row.partial_tokens,
            deadline=row.deadline,
            prefix_id=row.prefix_id if row.lease_prefix_tokens else None,
            prefix_tokens=row.lease_prefix_tokens if row.prefix_id else 0,
        )
        for row in repo.recovery.active_leases()
        if row.lease_id is not None
        and row.fencing_token is not None
        and row.reservation_tokens is not None
        and row.lease_expires_at is not None
        and row.node in known
    ]
    report = ledger.rebuild(nodes, leases, repo.recovery.next_ledger_epoch(), only=only)
    if report.unlisted:
        log.warning(
            "ledger: nodes %s have a pool but were not rebuilt (registered meanwhile, or not "
            "in Postgres): closed until the next rebuild",
            ", ".join(report.unlisted),
        )
    log.warning(
        "ledger rebuilt from Postgres (%s): epoch %s, %s leases restored, %s skipped",
        "every node" if only is None else "nodes " + ", ".join(sorted(only)),
        report.epoch,
        report.restored,
        report.skipped,
    )
    return report


def _refs(rows: Sequence[ActiveLeaseRow]) -> list[LeaseRef]:
    return [
        LeaseRef(r.node, r.lease_id, r.fencing_token)
        for r in rows
        if r.lease_id is not None and r.fencing_token is not None
    ]


def stop_in_flight(ledger: MaintenanceLedger, rows: Sequence[ActiveLeaseRow]) -> int:
    """Tell the workers holding ``rows`` to abort their engine requests now.

    The preempt notice reaches a preemptible lease's worker at once; every holder also finds
    its claim gone at its next heartbeat. Each worker releases its own lease once its request
    is aborted, so no engine work runs without a reservation in the meantime.
    """
    told = 0
    by_node: dict[str, list[str]] = {}
    for ref in _refs(rows):
        by_node.setdefault(ref.node, []).append(ref.lease_id)
    for node, lease_ids in by_node.items():
        try:
            told += len(ledger.preempt(node, 0, victims=lease_ids).victims)
        except LedgerError as exc:
            log.warning("could not notify node %s of stopped items: %s", node, exc)
    return told


@dataclass
class TickReport:
    rebuilt: RebuildReport | None = None
    requeued_lost: int = 0
    failed_lost: int = 0
    """Items failed because their worker died under them as often as the attempt cap."""
    released: int = 0
    reaped_leases: int = 0
    expired_jobs: list[str] = field(default_factory=list)
    cancelled_in_flight: int = 0
    finalized: dict[str, JobState] = field(default_factory=dict)
    recovered: dict[str, JobState] = field(default_factory=dict)
    expired_files: list[str] = field(default_factory=list)
    purged: PurgeReport = field(default_factory=PurgeReport)
    """Jobs past their retention, and the rows that went with them."""


@dataclass(frozen=True)
class Reaped:
    requeued: int
    failed: int
    """Lost as often as ``max_lost_runs`` while running: failed, not requeued."""
    released: int
    expired_leases: int


def reap(
    repo: MaintenanceStore, ledger: MaintenanceLedger, *, max_lost_runs: int | None = None
) -> Reaped:
    """Requeue items of silent attempts (or fail those whose worker died under them
    ``max_lost_runs`` times), release their leases, reap expired leases."""
    lost = repo.recovery.reap_lost(max_lost_runs=max_lost_runs)
    failed = [r for r in lost if r.failed]
    for r in failed:
        log.warning(
            "item %s failed: its worker was lost running it (cap %s)", r.item_id, max_lost_runs
        )
    released = sum(1 for status in ledger.release_many(_refs(lost)) if status.value == "released")
    # Every node's expired leases in one round trip: a fleet of 1,000 nodes took 1,000 a tick.
    reaped = sum(len(ids) for ids in ledger.reap_many(ledger.nodes()))
    return Reaped(len(lost) - len(failed), len(failed), released, reaped)


def retention_warning(settings: Settings, autovacuum: bool) -> str | None:
    """What the beat says at start when its purges would not shrink anything: retention on, and
    a Postgres server that runs no autovacuum (None: nothing to say)."""
    if settings.retention_s <= 0 or autovacuum:
        return None
    return (
        "Postgres runs with autovacuum off: the retention purge deletes ended batches' rows, "
        "but their space is reused only after a VACUUM, so the items table grows by every "
        "purged batch; turn autovacuum on or schedule VACUUM items, attempts, webhook_events"
    )


def tick(
    repo: MaintenanceStore,
    ledger: MaintenanceLedger,
    settings: Settings,
    *,
    clock: Callable[[], float] = time.monotonic,
) -> TickReport:
    """One round of upkeep (the body of the periodic task); the retention purge is timed on
    ``clock``."""
    report = TickReport()
    report.rebuilt = ensure_ledger(repo, ledger, max_preemptions=settings.max_preemptions_per_item)
    reaped = reap(repo, ledger, max_lost_runs=settings.max_attempts_per_item)
    report.requeued_lost, report.failed_lost = reaped.requeued, reaped.failed
    report.released, report.reaped_leases = reaped.released, reaped.expired_leases
    sweep = finalize.expire_due_jobs(repo)
    report.expired_jobs = sweep.expired_jobs
    stop_in_flight(ledger, sweep.in_flight)
    for job_id in repo.jobs.jobs_in_state(JobState.CANCELLING):
        stopped = repo.items.end_items(job_id, ItemState.CANCELLED)
        report.cancelled_in_flight += len(stopped)
        stop_in_flight(ledger, stopped)
    finalize.settle_cancelling_jobs(repo)
    report.finalized = finalize.finalize_ready_jobs(repo)
    report.recovered = finalize.recover_stale_validating(
        repo, older_than_s=settings.stale_validating_s
    )
    # Files past their expires_at already read as gone; here their rows and pieces go.
    report.expired_files = repo.files.delete_expired_files()
    if settings.retention_s > 0:
        report.purged = repo.retention.purge_ended_jobs(
            settings.retention_s, purge_pace(settings), clock=clock
        )
    return report
