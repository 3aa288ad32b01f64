"""Backfill worker: Celery app and tasks, and the adapters to the node's inference engine."""
