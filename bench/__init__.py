"""Benchmarks: Backfill and its named peer measured in the same run (python -m bench.NAME),
grouped by family (bench/README.md)."""
