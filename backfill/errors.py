"""Backfill's own error types. Driver errors are translated into these at the edge."""

from __future__ import annotations


class BackfillError(Exception):
    """Base of every error Backfill raises on purpose."""


class NotFound(BackfillError):
    """The object does not exist (or belongs to another tenant: the caller cannot tell).

    ``param`` names the request field that pointed at it (``input_file_id``), when one did."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Conflict(BackfillError):
    """The write clashes with existing data (duplicate id, idempotency key reuse, ...)."""


class StaleWrite(BackfillError):
    """A guarded transition matched no row: the state moved on, or a newer attempt or fencing
    token owns the item. The caller's view is stale; it must not retry the same write."""


class IllegalTransition(BackfillError):
    """The state machine does not allow this transition at all (a bug, not a race)."""


class InvalidInput(BackfillError):
    """The caller sent something Backfill refuses; the message says what and where."""


class StoreUnavailable(BackfillError):
    """Postgres or Redis could not be reached; the operation may be retried later."""


class LedgerError(BackfillError):
    """The ledger refused a call (malformed arguments, unknown node)."""


class StaleEpoch(LedgerError):
    """A newer ledger epoch is in place: another rebuild overtook this one (it may be retried
    from a fresh read of Postgres)."""


class LedgerUnavailable(StoreUnavailable):
    """Redis could not be reached, or the ledger is closed while it is rebuilt."""
