"""One Postgres transaction, with the driver's errors turned into Backfill's own types: the
one way every module that talks to Postgres (the store, the webhook outbox) opens one."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from backfill.errors import Conflict, InvalidInput, StoreUnavailable


@contextmanager
def transaction(engine: Engine, *, durable: bool = True) -> Iterator[Connection]:
    """One transaction on ``engine``; driver errors leave as Backfill's own types (every
    module that talks to Postgres goes through here).

    ``durable=False`` commits without waiting for the WAL flush. Only for writes whose
    loss in a Postgres crash is harmless by design: a lost claim or start leaves the item
    claimable again (or rescued by the reaper), and the worker's fenced writes then fail
    as stale instead of doing harm. Results are always written durably.
    """
    try:
        with engine.begin() as conn:
            if not durable:
                conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
            yield conn
    except IntegrityError as exc:
        raise Conflict(str(exc.orig)) from exc
    except OperationalError as exc:
        raise StoreUnavailable(f"Postgres unavailable: {exc.orig}") from exc
    except DataError as exc:
        # A value Postgres cannot hold (a NUL byte in text, a number out of range) that
        # came from outside: the caller's input, not a fault of the store.
        raise InvalidInput(f"value refused: {exc.orig}") from exc
    except psycopg.DataError as exc:
        # The same, from the driver directly (COPY and binary reads bypass SQLAlchemy).
        raise InvalidInput(f"value refused: {exc}") from exc
    except psycopg.OperationalError as exc:
        # A connection lost under a driver-level call (COPY, binary reads).
        raise StoreUnavailable(f"Postgres unavailable: {exc}") from exc
    except PoolTimeout as exc:
        # Every pooled connection is busy: the store is there but has no room for this
        # caller now, which a retry a little later may find.
        raise StoreUnavailable(f"no Postgres connection free: {exc}") from exc
    except DBAPIError as exc:
        if exc.connection_invalidated:
            raise StoreUnavailable(f"Postgres connection lost: {exc.orig}") from exc
        raise
