"""Backfill's HTTP API: OpenAI-compatible ``/v1/files`` and ``/v1/batches``, plus progress,
results streaming and the capacity view. Thin routes over the ``backfill`` core."""
