"""Benchmarks: Backfill and its named peer measured in the same run (python -m bench.NAME)."""
