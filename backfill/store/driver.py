"""The hot path's driver: the claim, start and finish statements sent as raw psycopg calls on
the store's pooled connections, prepared on the server, instead of through SQLAlchemy.

Why: a worker claims, starts and finishes a batch every few milliseconds, and through
SQLAlchemy each transaction cost five round trips (BEGIN, ``SET LOCAL``, the statement(s),
COMMIT) and a compile-and-process pass per call; a third of the claim path's time was the
client's (``bench.claim``). Here a transaction is pipelined (BEGIN, the setting and the first
statement leave together; COMMIT is one more round trip) and each statement is a server-side
prepared statement, parsed and planned once per connection.

The statements keep SQLAlchemy's ``:name`` parameters (the same text serves both paths, and
``EXPLAIN`` studies run it through SQLAlchemy); :func:`to_psycopg` rewrites them once.
Driver errors leave as Backfill's own types, as :func:`backfill.postgres.transaction` does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from backfill.errors import Conflict, InvalidInput, StoreUnavailable

# A bind parameter in SQLAlchemy's text() form: ``:name``, not a ``::type`` cast.
_BIND = re.compile(r"(?<![:\w\\]):(\w+)(?!:)")

Row = tuple[Any, ...]
"""A row as the connection returns it (``Session.rows`` names its fields)."""


def array_literal(values: Iterable[int | str | None]) -> str:
    """A Postgres array literal of ``values`` (ints, strings, None), for a parameter that the
    statement casts to its array type (``CAST(:ids AS bigint[])``).

    psycopg dumps a Python list element by element in Python, each string checked against a
    regular expression for quoting: on the claim path that was ~40% of the client's CPU
    (``bench.claim``, 64-item batches, results in the finish). One literal built with string
    methods costs a fraction of it, and the server parses it the same way."""
    return (
        "{"
        + ",".join(
            [
                "NULL"
                if v is None
                else str(v)
                if isinstance(v, int)
                else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
                for v in values
            ]
        )
        + "}"
    )


@cache
def to_psycopg(statement: str) -> str:
    """``statement`` with ``:name`` parameters as psycopg's ``%(name)s`` (literal ``%``
    doubled). Cached: the hot path's statements are a handful of constants."""
    return _BIND.sub(r"%(\1)s", statement.replace("%", "%%"))


class Session:
    """One transaction's statements on one psycopg connection."""

    __slots__ = ("_conn",)

    def __init__(self, conn: psycopg.Connection[Row]) -> None:
        self._conn = conn

    def rows(self, statement: str, params: Mapping[str, Any]) -> list[Any]:
        """Run ``statement`` (SQLAlchemy's ``:name`` form, returning rows) prepared; its rows,
        as named tuples."""
        cur = self._conn.cursor(row_factory=namedtuple_row)
        return cur.execute(to_psycopg(statement), params, prepare=True).fetchall()

    def column(self, statement: str, params: Mapping[str, Any]) -> list[Any]:
        """The first column of ``statement``'s rows."""
        return [r[0] for r in self.rows(statement, params)]


def raw_connection(engine: Engine) -> Any:
    """A pooled connection of ``engine`` (SQLAlchemy's pool proxy: ``driver_connection`` is
    the psycopg connection; ``close()`` gives it back, ``invalidate()`` drops it)."""
    try:
        return engine.raw_connection()
    except (OperationalError, PoolTimeout, psycopg.OperationalError) as exc:
        # The pool hands a failed connect up as the driver's own error, not SQLAlchemy's:
        # a server that is down (restarting) must read as unavailable, never crash a worker.
        raise StoreUnavailable(f"no Postgres connection: {exc}") from exc


@contextmanager
def driver_errors() -> Iterator[None]:
    """psycopg's errors as Backfill's own, as :func:`backfill.postgres.transaction` does."""
    try:
        yield
    except psycopg.IntegrityError as exc:
        raise Conflict(str(exc)) from exc
    except psycopg.DataError as exc:
        raise InvalidInput(f"value refused: {exc}") from exc
    except (psycopg.OperationalError, psycopg.errors.IdleInTransactionSessionTimeout) as exc:
        # The second: the server ended a transaction left open too long (an open claim's
        # bound), and the session with it.
        raise StoreUnavailable(f"Postgres unavailable: {exc}") from exc


@contextmanager
def session(engine: Engine, *, durable: bool = True) -> Iterator[Session]:
    """One pipelined transaction on a pooled connection of ``engine``.

    ``durable=False`` commits without waiting for the WAL flush (see
    :func:`backfill.postgres.transaction` for which writes may). A connection the server
    dropped is taken out of the pool.
    """
    fairy = raw_connection(engine)
    conn = fairy.driver_connection
    assert isinstance(conn, psycopg.Connection)
    try:
        with driver_errors(), conn.pipeline(), conn.transaction():
            if not durable:
                conn.execute("SET LOCAL synchronous_commit = off")
            yield Session(conn)
    finally:
        if conn.broken or conn.closed:
            fairy.invalidate()
        fairy.close()


def single(engine: Engine, statement: str, params: Mapping[str, Any]) -> list[Any]:
    """Run one durable statement (SQLAlchemy's ``:name`` form) as its own transaction, prepared,
    in one round trip: the server commits it as it ends (autocommit), where an explicit
    transaction costs a second round trip for its COMMIT. For a statement whose writes, CTEs
    and all, are the whole transaction. Its rows' first column."""
    fairy = raw_connection(engine)
    conn = fairy.driver_connection
    assert isinstance(conn, psycopg.Connection)
    try:
        with driver_errors():
            conn.autocommit = True
            try:
                cur = conn.execute(to_psycopg(statement), params, prepare=True)
                return [r[0] for r in cur.fetchall()]
            finally:
                if not (conn.broken or conn.closed):
                    conn.autocommit = False
    finally:
        if conn.broken or conn.closed:
            fairy.invalidate()
        fairy.close()
