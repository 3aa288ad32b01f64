"""What a ledger operation asks of Redis, as values, so one operation serves both ledgers.

An operation (:mod:`backfill.ledger.operations`) is a generator: it yields steps and
receives each step's parsed reply, then returns its result. A step is one script call, a
batch of script calls pipelined in one round trip, a plain Redis command on one key, or a
scan of the key space. Each script call and command touches one hash slot, so on a Redis
Cluster the client routes it to the shard that holds it. The
synchronous and the asyncio ledger differ only in how they carry a step out.

Redis errors become :class:`~backfill.errors.LedgerUnavailable` and script refusals
:class:`~backfill.errors.LedgerError` (:func:`translate`), in the ledgers and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import redis
from redis.exceptions import (
    AskError,
    ClusterDownError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)

from backfill import keys as lk
from backfill.errors import LedgerError, LedgerUnavailable, StaleEpoch
from backfill.ledger.scripts import script_source
from backfill.ledger.values import PartialBatchError

T = TypeVar("T")


@dataclass(frozen=True)
class ScriptCall(Generic[T]):
    """One call of a ledger script, atomic in Redis, and how to read its reply."""

    script: str
    keys: list[str]
    args: list[str]
    parse: Callable[[Any], T]


@dataclass(frozen=True)
class Pipelined(Generic[T]):
    """Script calls sent in one round trip. Call ``k`` answers for the requests at
    ``groups[k]``'s indices; the results come back scattered into request order."""

    calls: list[ScriptCall[list[Any]]]
    groups: list[tuple[str, list[int]]]
    size: int

    def parse(self, replies: Sequence[Any]) -> list[T]:
        return parse_all(self.calls, replies, self.groups, self.size)


@dataclass(frozen=True)
class Command(Generic[T]):
    """A plain Redis command (readiness marker, pool counters, the pool list)."""

    args: tuple[str | int, ...]
    parse: Callable[[Any], T]


@dataclass(frozen=True)
class Commands:
    """Plain commands sent in one round trip (on a cluster, grouped by the shard of each
    command's key); the replies come back parsed, in order. A command Redis refused raises
    (translated) once every reply is in."""

    commands: list[Command[Any]]

    def parse(self, replies: Sequence[Any]) -> list[Any]:
        for reply in replies:
            if isinstance(reply, REDIS_ERRORS):
                raise translate(reply)
        return [c.parse(r) for c, r in zip(self.commands, replies, strict=True)]


@dataclass(frozen=True)
class Scan:
    """Every key matching ``pattern``, over every shard of a cluster (``SCAN`` cursors are
    per server, so the client iterates; its reply is the list of keys)."""

    pattern: str

    def parse(self, reply: list[Any]) -> list[str]:
        return sorted({k.decode() if isinstance(k, bytes) else str(k) for k in reply})


Step = ScriptCall[Any] | Pipelined[Any] | Command[Any] | Commands | Scan
Plan = Generator[Step, Any, T]
"""An operation: yields steps, is sent each step's parsed reply, returns its result."""


REDIS_ERRORS = (redis.RedisError, RedisClusterException)
"""What a client of one server or of a cluster raises (redis-py's cluster errors about slots
no node serves derive from ``Exception``, not ``RedisError``)."""

_CLUSTER_UNAVAILABLE = (ClusterDownError, TryAgainError, AskError, RedisClusterException)
"""A shard failing over, or a slot between owners: answers of a cluster that cannot serve the
key now (some are ``ResponseError`` by class), not refusals of the ledger."""


def translate(exc: Exception) -> LedgerError | LedgerUnavailable:
    if isinstance(exc, ResponseError) and not isinstance(exc, _CLUSTER_UNAVAILABLE):
        message = str(exc).split(" script: ", 1)[0]
        if "stale epoch" in message:
            return StaleEpoch(message)
        return LedgerError(message)
    return LedgerUnavailable(f"Redis is unavailable: {exc}")


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def by_node(items: Sequence[T], node_of: Callable[[T], str]) -> list[tuple[str, list[int]]]:
    """Indices of ``items`` grouped by node (in order of first appearance), in chunks that keep
    each script call short."""
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(node_of(item), []).append(i)
    return [
        (node, list(chunk)) for node, idx in groups.items() for chunk in chunks(idx, lk.BATCH_CHUNK)
    ]


def scatter(size: int, groups: list[tuple[str, list[int]]], results: list[Any]) -> list[Any]:
    out: list[Any] = [None] * size
    for (_, idx), result in zip(groups, results, strict=True):
        for j, i in enumerate(idx):
            out[i] = result if isinstance(result, Exception) else result[j]
    return out


def parse_all(
    calls: Sequence[ScriptCall[list[Any]]],
    replies: Sequence[Any],
    groups: list[tuple[str, list[int]]],
    size: int,
) -> list[Any]:
    """Each call's parsed results, scattered back to request order; raises
    :class:`PartialBatchError` (with every request's result or error) if any call failed."""
    per_call: list[Any] = []
    failed = 0
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, REDIS_ERRORS):
            per_call.append(translate(reply))
            failed += 1
        else:
            per_call.append(call.parse(reply))
    results = scatter(size, groups, per_call)
    if failed:
        first = next(r for r in per_call if isinstance(r, Exception))
        raise PartialBatchError(f"{failed} of {len(calls)} calls failed; first: {first}", results)
    return results


def eval_args(call: ScriptCall[Any]) -> tuple[Any, ...]:
    """``call`` as an EVAL command (the script's whole source, its keys and arguments): what
    runs a call where its script is not cached, e.g. on a replica promoted by a failover."""
    return ("EVAL", script_source(call.script), len(call.keys), *call.keys, *call.args)
