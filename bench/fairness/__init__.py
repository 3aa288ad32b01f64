"""Tenant fairness: two tenants on one node, fair-share claims against plain EDF (``python -m
bench.fairness``)."""
