"""Alembic migrations for Backfill's Postgres schema (run with ``backfill migrate``)."""
