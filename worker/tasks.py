"""Celery tasks: the periodic maintenance tick (and with it the summarisation jobs' reduce
driver)."""

from __future__ import annotations

import logging
from functools import cache

from backfill.config import get_settings
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy, tick
from backfill.store import Repository
from backfill.summarize import driver as summary_driver
from worker.celery_app import app

log = logging.getLogger("backfill.maintenance")


@cache
def _stores() -> tuple[Repository, Ledger]:
    settings = get_settings()
    repo = Repository.connect(settings.database_url, pool_size=2)
    ledger = Ledger.from_url(
        settings.redis_url,
        settings.redis_namespace,
        pool_policy(settings),
        lease_ttl_ms=int(settings.lease_ttl_s * 1000),
    )
    return repo, ledger


@app.task(name="backfill.maintenance.tick", acks_late=True)  # type: ignore[untyped-decorator]
def maintenance_tick() -> dict[str, object]:
    """Rebuild the ledger if lost, reap silent attempts, expire, stop cancelled work, finalize,
    recover creates that died in validating."""
    repo, ledger = _stores()
    settings = get_settings()
    report = tick(repo, ledger, settings)
    # Summarisation jobs move on as their batches do: chunk summaries in, reduce steps out.
    summaries = summary_driver.drive(repo, settings)
    if summaries.batches or summaries.jobs_ended:
        log.info(
            "summaries: %s reduce steps made, %s batches made, %s documents and %s jobs ended",
            summaries.reduce_steps,
            summaries.batches,
            summaries.documents_ended,
            summaries.jobs_ended,
        )
    if (
        report.requeued_lost
        or report.failed_lost
        or report.expired_jobs
        or report.finalized
        or report.rebuilt
        or report.recovered
    ):
        log.info(
            "maintenance: requeued %s lost items, failed %s at the attempt cap, expired %s "
            "jobs, finalized %s, recovered from validating %s",
            report.requeued_lost,
            report.failed_lost,
            len(report.expired_jobs),
            report.finalized,
            report.recovered,
        )
    if report.purged.rows or report.purged.jobs or report.purged.summary_jobs:
        log.info(
            "maintenance: purged %s batches and %s summary jobs past their retention (%s rows)",
            report.purged.jobs,
            report.purged.summary_jobs,
            report.purged.rows,
        )
    return {
        "requeued_lost": report.requeued_lost,
        "failed_lost": report.failed_lost,
        "expired_jobs": report.expired_jobs,
        "finalized": {k: v.value for k, v in report.finalized.items()},
        "recovered": {k: v.value for k, v in report.recovered.items()},
        "purged_jobs": report.purged.jobs,
        "purged_summary_jobs": report.purged.summary_jobs,
        "summary_steps_harvested": summaries.harvested,
        "summary_batches_made": summaries.batches,
    }
