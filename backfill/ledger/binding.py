"""How the two ledgers expose the operations: one descriptor per kind of ledger.

``reserve = blocking(operations.reserve)`` in :class:`~backfill.ledger.Ledger` makes
``ledger.reserve(node, ...)`` build the plan with the ledger's calls and drive it to its
result; ``awaiting(...)`` does the same in :class:`~backfill.ledger.AsyncLedger`, as a
coroutine. The signature seen by callers (and by mypy) is the operation's, less its first
argument.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, Self, TypeVar, overload

from backfill.ledger.calls import LedgerCalls
from backfill.ledger.steps import Plan

P = ParamSpec("P")
T = TypeVar("T")


class BlockingDriver(Protocol):
    """A ledger that carries plans out synchronously."""

    @property
    def calls(self) -> LedgerCalls: ...

    def drive(self, plan: Plan[T]) -> T: ...


class AwaitingDriver(Protocol):
    """A ledger that carries plans out on asyncio."""

    @property
    def calls(self) -> LedgerCalls: ...

    async def drive(self, plan: Plan[T]) -> T: ...


class blocking(Generic[P, T]):  # noqa: N801 (used like a decorator)
    """An operation as a method of a synchronous ledger."""

    def __init__(self, operation: Callable[Concatenate[LedgerCalls, P], Plan[T]]) -> None:
        self.operation = operation
        self.__doc__ = operation.__doc__

    @overload
    def __get__(self, ledger: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, ledger: BlockingDriver, owner: type[Any]) -> Callable[P, T]: ...
    def __get__(self, ledger: BlockingDriver | None, owner: type[Any]) -> Self | Callable[P, T]:
        if ledger is None:
            return self
        operation = self.operation

        def run(*args: P.args, **kwargs: P.kwargs) -> T:
            return ledger.drive(operation(ledger.calls, *args, **kwargs))

        run.__name__ = operation.__name__
        run.__doc__ = operation.__doc__
        return run


class awaiting(Generic[P, T]):  # noqa: N801 (used like a decorator)
    """An operation as a coroutine method of an asyncio ledger."""

    def __init__(self, operation: Callable[Concatenate[LedgerCalls, P], Plan[T]]) -> None:
        self.operation = operation
        self.__doc__ = operation.__doc__

    @overload
    def __get__(self, ledger: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, ledger: AwaitingDriver, owner: type[Any]) -> Callable[P, Awaitable[T]]: ...
    def __get__(
        self, ledger: AwaitingDriver | None, owner: type[Any]
    ) -> Self | Callable[P, Awaitable[T]]:
        if ledger is None:
            return self
        operation = self.operation

        async def run(*args: P.args, **kwargs: P.kwargs) -> T:
            return await ledger.drive(operation(ledger.calls, *args, **kwargs))

        run.__name__ = operation.__name__
        run.__doc__ = operation.__doc__
        return run
