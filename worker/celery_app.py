"""The Celery app: Redis broker, settings fit for long work, and the maintenance schedule.

Celery does not carry items (one message per item would cap the machine at ~1k items/s, see
shared notes): the node dispatcher pulls them from Postgres. Celery carries the periodic
maintenance (reap, rebuild, expire, finalize) and runs the worker processes. Delivery is at
least once, so every task is idempotent and every effect fenced in Postgres.
"""

from __future__ import annotations

from celery import Celery

from backfill.config import Settings, get_settings


def maintenance_queue(settings: Settings) -> str:
    # One queue per ledger namespace: deployments (and tests) sharing a Redis never run each
    # other's upkeep.
    return f"{settings.redis_namespace}.maintenance"


def make_app(settings: Settings) -> Celery:
    app = Celery("backfill", broker=settings.celery_broker_url, include=["worker.tasks"])
    queue = maintenance_queue(settings)
    app.conf.update(
        task_default_queue=queue,
        task_acks_late=True,
        worker_prefetch_multiplier=1,
        # Redelivery after a lost worker comes from our own leases and reaper, not from
        # Celery: rejecting on worker loss can loop a poison task forever.
        task_reject_on_worker_lost=False,
        task_ignore_result=True,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        worker_send_task_events=False,
        # Ticks are short; an hour of visibility timeout never re-delivers one that ran.
        broker_transport_options={"visibility_timeout": 3600},
        beat_schedule={
            "maintenance": {
                "task": "backfill.maintenance.tick",
                "schedule": settings.reaper_interval_s,
                # A tick that waited longer than one interval is superseded by the next one.
                "options": {"queue": queue, "expires": settings.reaper_interval_s},
            }
        },
    )
    return app


app = make_app(get_settings())
