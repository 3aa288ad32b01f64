"""What the two ledgers share: their client, calls and scripts, and every operation, bound once.

:class:`LedgerBinding` holds the client, the namespace's calls and the registered scripts, and
binds each operation of :mod:`backfill.ledger.operations` as ``reserve =
operation(operations.reserve)``. A ledger built on it says only how it carries a step out, in
its ``drive``: :class:`~backfill.ledger.Ledger` runs each step as it comes, and
``ledger.reserve(node, ...)`` builds the plan with the ledger's calls and drives it to its
result; :class:`~backfill.ledger.AsyncLedger` awaits each step, and ``ledger.reserve(...)`` is
a coroutine that does the same. The signature seen by callers (and by mypy) is the
operation's, less its first argument.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine
from typing import (
    Any,
    Concatenate,
    Final,
    Generic,
    ParamSpec,
    Protocol,
    Self,
    TypeGuard,
    TypeVar,
    cast,
    overload,
)

from backfill import keys as lk
from backfill.ledger import operations
from backfill.ledger.calls import LedgerCalls
from backfill.ledger.rebuild import rebuild as rebuild_plan
from backfill.ledger.scripts import SCRIPTS, script_source
from backfill.ledger.steps import Plan
from backfill.policy import PoolPolicy

P = ParamSpec("P")
T = TypeVar("T")
C = TypeVar("C")
"""The Redis client a ledger runs on."""
S = TypeVar("S")
"""A script registered on that client."""


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


def _awaits(ledger: BlockingDriver | AwaitingDriver) -> TypeGuard[AwaitingDriver]:
    return inspect.iscoroutinefunction(ledger.drive)


class operation(Generic[P, T]):  # noqa: N801 (used like a decorator)
    """An operation as a method of a ledger: a plain method of a synchronous one, a coroutine
    method of an asyncio one."""

    def __init__(self, plan: Callable[Concatenate[LedgerCalls, P], Plan[T]]) -> None:
        self.plan = plan
        self.__doc__ = plan.__doc__

    @overload
    def __get__(self, ledger: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(
        self, ledger: AwaitingDriver, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    @overload
    def __get__(self, ledger: BlockingDriver, owner: type[Any]) -> Callable[P, T]: ...
    def __get__(
        self, ledger: BlockingDriver | AwaitingDriver | None, owner: type[Any]
    ) -> Self | Callable[P, T] | Callable[P, Coroutine[Any, Any, T]]:
        if ledger is None:
            return self
        plan = self.plan
        run: Callable[P, T] | Callable[P, Coroutine[Any, Any, T]]
        if _awaits(ledger):
            awaiting = ledger

            async def run_awaiting(*args: P.args, **kwargs: P.kwargs) -> T:
                return await awaiting.drive(plan(awaiting.calls, *args, **kwargs))

            run = run_awaiting
        else:
            blocking = cast(BlockingDriver, ledger)

            def run_blocking(*args: P.args, **kwargs: P.kwargs) -> T:
                return blocking.drive(plan(blocking.calls, *args, **kwargs))

            run = run_blocking
        run.__name__ = plan.__name__
        run.__doc__ = plan.__doc__
        return run


class LedgerBinding(ABC, Generic[C, S]):
    """A ledger on a Redis client of type ``C`` (one server or a cluster), whose scripts
    register as ``S``; :class:`~backfill.ledger.Ledger` and
    :class:`~backfill.ledger.AsyncLedger` add how each step is carried out."""

    def __init__(
        self,
        client: C,
        namespace: str,
        policy: PoolPolicy | None = None,
        lease_ttl_ms: int = 30_000,
    ) -> None:
        self._client = client
        self.calls: Final = LedgerCalls(namespace, policy or PoolPolicy(), lease_ttl_ms)
        """How each script call of this namespace is written (KEYS, ARGV, reply parsing)."""
        self.keys: Final[lk.LedgerKeys] = self.calls.keys
        """The names of this namespace's keys."""
        self.policy: Final[PoolPolicy] = self.calls.policy
        """The pool policy (what a pool registered without one of its own gets)."""
        self._scripts = {name: self._register(client, script_source(name)) for name in SCRIPTS}

    @classmethod
    def from_url(
        cls, url: str, namespace: str, policy: PoolPolicy | None = None, lease_ttl_ms: int = 30_000
    ) -> Self:
        """A ledger on ``url``: one Redis server or a cluster (``redis+cluster://``)."""
        return cls(cls._connect(url), namespace, policy, lease_ttl_ms)

    @classmethod
    @abstractmethod
    def _connect(cls, url: str) -> C:
        """The client for ``url`` (each ledger says which kind)."""

    @abstractmethod
    def _register(self, client: C, source: str) -> S:
        """``source`` registered as a script on ``client``."""

    @property
    def client(self) -> C:
        """The Redis client, for the small non-ledger keys kept beside the ledger (work
        budgets, interactive signals)."""
        return self._client

    # -- the operations (documented in backfill.ledger.operations)

    register_pool = operation(operations.register_pool)
    observe = operation(operations.observe)
    snapshot = operation(operations.snapshot)
    counters = operation(operations.counters)
    nodes = operation(operations.nodes)
    is_ready = operation(operations.is_ready)
    incomplete_nodes = operation(operations.incomplete_nodes)
    mark_incomplete = operation(operations.mark_incomplete)
    reserve = operation(operations.reserve)
    reserve_many = operation(operations.reserve_many)
    settle = operation(operations.settle)
    settle_many = operation(operations.settle_many)
    heartbeat = operation(operations.heartbeat)
    heartbeat_many = operation(operations.heartbeat_many)
    restore_lease = operation(operations.restore_lease)
    release = operation(operations.release)
    release_many = operation(operations.release_many)
    release_unconfirmed = operation(operations.release_unconfirmed)
    preempt = operation(operations.preempt)
    reap = operation(operations.reap)
    reap_many = operation(operations.reap_many)
    rebuild = operation(rebuild_plan)
