"""Backfill worker: Celery app and tasks, the node dispatcher that feeds one engine from its
batch slack, and what it adds to the core's engine client (resuming preempted requests)."""
