"""``backfill worker`` and ``backfill beat``: Celery processes with the node dispatcher."""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from celery import signals

from backfill import logs
from backfill.config import Settings
from backfill.errors import BackfillError
from backfill.maintenance import retention_warning
from backfill.store import Repository
from backfill.webhooks.delivery import SenderThread
from worker.celery_app import maintenance_queue, make_app
from worker.node import NodeThread

log = logging.getLogger("backfill.worker")

DRAIN_AFTER_GRACE_S = 30
"""How long a stopping worker waits, past the grace period, for its dispatcher's aborts,
requeues and lease releases (the Kubernetes grace period is sized on it)."""


def run_worker(settings: Settings, node: str, engine_url: str, *, beat: bool = False) -> None:
    """A Celery worker for ``node`` (maintenance queue) with the node's dispatcher beside it.

    SIGTERM (Celery's warm shutdown) stops claiming at once, lets in-flight items finish for
    the grace period, then aborts and requeues the rest and releases every lease.
    """
    _configure_logging(settings)
    app = make_app(settings)
    thread = NodeThread(settings, node, engine_url)

    # The process that schedules maintenance also delivers webhooks (several may: deliveries
    # are claimed in Postgres).
    webhooks = SenderThread(settings) if beat else None

    def on_ready(**_: Any) -> None:
        thread.start()
        if webhooks is not None:
            webhooks.start()

    def on_shutting_down(**_: Any) -> None:
        log.info("node %s: stopping (grace %.0f s)", node, settings.shutdown_grace_s)
        thread.stop()
        if webhooks is not None:
            webhooks.stop()

    def on_shutdown(**_: Any) -> None:
        waited = settings.shutdown_grace_s + DRAIN_AFTER_GRACE_S
        thread.join(waited)
        if thread.stats is not None:
            log.info("node %s stopped: %s", node, thread.stats)
        elif thread.is_alive():
            # The process exits now: what the dispatcher still held comes back when its leases
            # expire (the reaper requeues the items), not at once.
            log.warning(
                "node %s: the dispatcher did not stop within %.0f s; its leases end at expiry; "
                "where it stands:\n%s",
                node,
                waited,
                thread.where(),
            )

    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_shutting_down.connect(on_shutting_down, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)
    argv = [
        "worker",
        "--queues",
        maintenance_queue(settings),
        "--pool",
        "solo",
        "--hostname",
        f"{node}@%h",
        "--without-gossip",
        "--without-mingle",
        "--loglevel",
        settings.log_level,
    ]
    if beat:
        schedule = os.path.join(tempfile.gettempdir(), f"backfill-beat-{settings.redis_namespace}")
        argv += ["--beat", "--schedule", schedule]
    app.worker_main(argv)


def _configure_logging(settings: Settings) -> None:
    logs.configure(settings.log_level, settings.log_format)
    form = logs.formatter(settings.log_format)

    def celery_lines(logger: logging.Logger, **_: Any) -> None:
        # Celery sets up its own handlers; its lines take the same form as Backfill's.
        for handler in logger.handlers:
            handler.setFormatter(form)

    signals.after_setup_logger.connect(celery_lines, weak=False)
    signals.after_setup_task_logger.connect(celery_lines, weak=False)


def _say_if_purges_leave_bloat(settings: Settings) -> None:
    repo = Repository.connect(settings.database_url, pool_size=1)
    try:
        warning = retention_warning(settings, repo.retention.server_autovacuums())
    except BackfillError as exc:
        log.warning("could not read Postgres' autovacuum setting: %s", exc)
        return
    finally:
        repo.close()
    if warning is not None:
        log.warning(warning)


def run_beat(settings: Settings) -> None:
    """Celery beat: schedules the maintenance tick (run exactly one per deployment), and
    delivers webhooks on a thread beside it."""
    _configure_logging(settings)
    _say_if_purges_leave_bloat(settings)
    app = make_app(settings)
    schedule = os.path.join(tempfile.gettempdir(), f"backfill-beat-{settings.redis_namespace}")
    webhooks = SenderThread(settings).start()
    try:
        app.start(
            [
                "beat",
                "--schedule",
                schedule,
                "--loglevel",
                settings.log_level,
            ]
        )
    finally:
        webhooks.stop()
