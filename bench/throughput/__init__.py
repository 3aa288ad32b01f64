"""Batch throughput: Backfill end to end against ``vllm run-batch`` and a direct asyncio client
(``python -m bench.throughput``)."""
