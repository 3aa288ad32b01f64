"""Benchmarks: each measures Backfill and its named peer in the same run (``python -m bench.NAME``)."""
