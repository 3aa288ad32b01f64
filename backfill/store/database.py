"""The store's connection to Postgres: a pooled engine, transactions that turn driver errors
into Backfill's own, and Postgres' clock. Every role of the store is built over one
:class:`Database` (the repository hands the same one to each).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy import Connection, Engine, text

from backfill.clock import HostClock, SharedClock
from backfill.errors import StoreUnavailable
from backfill.postgres import transaction

# Whether the server answers (health checks).
PING = "SELECT 1"
# The database's own clock, not the transaction's start: what stored timestamps are judged by.
DATABASE_TIME = "SELECT EXTRACT(EPOCH FROM clock_timestamp())"
# Whether a database exists (the dev command creates it when not).
DATABASE_EXISTS = "SELECT 1 FROM pg_database WHERE datname = %s"


def ensure_database(server_url: str, name: str) -> str:
    """Create database ``name`` on the server of ``server_url`` unless it exists; returns its
    URL (SQLAlchemy form). For the dev command and tools, not for request paths."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"database name must be letters, digits and underscores: {name!r}")
    with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
        if conn.execute(DATABASE_EXISTS, (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server_url.rpartition('/')[0]}/{name}"


def _libpq(url: str) -> str:
    return "postgresql://" + url.partition("://")[2]


class Database:
    """The connection source every role of the store shares: the pooled engine, how claims
    order tenants, and Postgres' clock. Thread-safe (a pooled SQLAlchemy engine).

    ``fair_share`` is how claims order tenants: by weighted fair share of the node (the
    default), or, when False, earliest deadline first across all tenants (the order before
    tenants were shared; kept to compare against).
    """

    def __init__(
        self, engine: Engine, *, fair_share: bool = True, host_clock: HostClock = time.time
    ) -> None:
        self.engine = engine
        self.fair_share = fair_share
        # Postgres' clock, read here: stored timestamps are judged, and new ones computed, on
        # it (this host's clock, ``host_clock``, may be off).
        self._clock = SharedClock(host=host_clock)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def transaction(self, *, durable: bool = True) -> Iterator[Connection]:
        """One transaction (see :func:`backfill.postgres.transaction`)."""
        with transaction(self.engine, durable=durable) as conn:
            yield conn

    def read_binary(self, query: str, params: tuple[Any, ...]) -> bytes | None:
        """One bytea value read in binary format: a text-format read hex-encodes it,
        doubling what crosses the wire and costing seconds to decode for 100 MB."""
        with self.transaction() as conn:
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            with raw.cursor(binary=True) as cur:
                found = cur.execute(query, params).fetchone()
        return None if found is None or found[0] is None else bytes(found[0])

    def ping(self) -> None:
        with self.transaction() as conn:
            conn.execute(text(PING))

    def now(self) -> datetime:
        """The time on Postgres' clock, without a round trip (re-anchored every few seconds):
        what a process judges stored timestamps by and computes new ones from. Postgres out
        of reach: the last anchor goes on (``StoreUnavailable`` if there is none yet)."""
        if self._clock.due():
            try:
                self._clock.sync_blocking(self._database_time)
            except StoreUnavailable:
                if not self._clock.anchored:
                    raise
        return datetime.fromtimestamp(self._clock.now(), UTC)

    def _database_time(self) -> float:
        with self.transaction() as conn:
            return float(conn.execute(text(DATABASE_TIME)).scalar_one())
