"""Postgres faults staged on the real server for integration tests."""

from __future__ import annotations

import psycopg

from backfill.config import libpq_url


def kill_connections(database_url: str) -> int:
    """Terminate every other session of this test's database, as a Postgres restart does."""
    with psycopg.connect(libpq_url(database_url), autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row else 0
