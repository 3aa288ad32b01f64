"""The control plane a simulated node of ``bench.fleet`` calls (:class:`Plane`), the settings
that shape its traffic (:class:`NodeConfig`), a claim carried to its start
(:func:`claim_to_start`), and :class:`BackfillPlane`, which carries the calls out with
Backfill's ``Repository`` and ``AsyncLedger`` (a claim's window with the synchronous ``Ledger``
in one thread, as a node of its own would).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from backfill.errors import BackfillError, StaleWrite
from backfill.keys import LedgerKeys
from backfill.ledger import AsyncLedger, Denial, Ledger, PartialBatchError, ReserveRequest
from backfill.policy import ServiceClass
from backfill.redis_client import AsyncRedis
from backfill.states import ItemState
from backfill.store import ClaimedItem, Finish, OpenClaim, Repository, Start

RESULT = json.dumps(
    {
        "id": "bf-0",
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "x" * 1200},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 300, "total_tokens": 1300},
    }
)
"""A summary's result body (~1.3 KB)."""

T = TypeVar("T")


@dataclass(frozen=True)
class NodeConfig:
    """The dispatcher settings that shape control-plane traffic (``DispatchConfig``'s
    defaults, with the ``Settings`` a worker runs with)."""

    claim_batch: int = 64
    max_in_flight: int = 128
    lease_ttl_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    idle_poll_s: float = 0.5
    result_flush_s: float = 0.05
    settle_every_tokens: int = 32
    observe_interval_s: float = 1.0
    budget_interval_s: float = 0.25
    signal_ttl_s: float = 3.0
    block_size: int = 16
    max_preemptions: int = 3
    settle_interval_s: float = 1.0
    settle_batched: bool = True
    """As the dispatcher does now: each node's progress in one ``settle_many`` per
    ``settle_interval_s``. False: one ``settle`` per item per ``settle_every_tokens``, as it
    did before (``--per-item-settle``, the before of the fix)."""


@dataclass(frozen=True, slots=True)
class Held:
    item_id: int
    attempt: int
    prompt_tokens: int
    max_output_tokens: int
    deadline_ms: int
    lease: Any = None


@dataclass
class Opened:
    """A claim carried to its start: what was claimed, how many of those the slack took, the
    leased (each with its lease) and the refused of those, the ids the start applied to, and
    each call's seconds, to be recorded by the node."""

    claimed: list[Held] = field(default_factory=list)
    fits: int = 0
    leased: list[Held] = field(default_factory=list)
    refused: list[Held] = field(default_factory=list)
    applied: set[int] = field(default_factory=set)
    timings: list[tuple[str, float]] = field(default_factory=list)


def fit_to_slack(claimed: Sequence[Held], slack: int, block_size: int) -> int:
    """How many of ``claimed``, in order, the slack takes (each rounded up to whole blocks);
    the first always goes to the ledger, which decides (``NodeDispatcher._fit_to_slack``)."""
    used = 0
    for n, h in enumerate(claimed):
        need = -(-(h.prompt_tokens + h.max_output_tokens) // block_size) * block_size
        if used + need > slack and n:
            return n
        used += need
    return len(claimed)


def split_outcomes(fits: Sequence[Held], outcomes: Sequence[Any]) -> tuple[list[Held], list[Held]]:
    """The leased (each now holding its lease) and the refused, from ``reserve_many``."""
    leased: list[Held] = []
    refused: list[Held] = []
    for h, outcome in zip(fits, outcomes, strict=True):
        if isinstance(outcome, Denial | BaseException):
            refused.append(h)
        else:
            leased.append(
                Held(
                    h.item_id,
                    h.attempt,
                    h.prompt_tokens,
                    h.max_output_tokens,
                    h.deadline_ms,
                    outcome,
                )
            )
    return leased, refused


class Plane(Protocol):
    """The calls a node makes, whoever carries them out."""

    async def claim_to_start(
        self, node: str, want: int, ttl_s: float, block_size: int
    ) -> Opened: ...
    async def snapshot(self, node: str) -> int: ...
    async def claim(self, node: str, want: int, ttl_s: float) -> list[Held]: ...
    async def unclaim(self, node: str, held: Sequence[Held]) -> None: ...
    async def reserve_many(self, node: str, held: Sequence[Held]) -> list[Any]: ...
    async def give_back(self, held: Held) -> None: ...
    async def start_many(
        self, node: str, leased: Sequence[Held], refused: Sequence[Held], ttl_s: float
    ) -> set[int]: ...
    async def drop(self, node: str) -> None: ...
    async def settle(self, node: str, held: Held, generated: int) -> None: ...
    async def settle_many(self, node: str, progress: Sequence[tuple[Held, int]]) -> None: ...
    async def heartbeat_claims(self, held: Sequence[Held], ttl_s: float) -> set[int]: ...
    async def heartbeat_leases(self, node: str, held: Sequence[Held], ttl_s: float) -> None: ...
    async def finish(self, done: Sequence[tuple[Held, int]]) -> set[int]: ...
    async def release(self, held: Sequence[Held]) -> None: ...
    async def observe(self, node: str) -> None: ...
    async def listen(self, node: str) -> None: ...
    @property
    def client(self) -> AsyncRedis: ...
    @property
    def keys(self) -> LedgerKeys: ...


async def claim_to_start(
    plane: Plane, node: str, want: int, ttl_s: float, block_size: int
) -> Opened:
    """``NodeDispatcher``'s claim to its start, each call awaited on the node's loop: claim,
    snapshot, fit to the slack (``unclaim`` the rest), ``reserve_many``, ``start_many``; a
    claim left open by a failure is dropped, nothing written."""
    opened = Opened()

    async def timed(name: str, call: Awaitable[T]) -> T:
        t0 = time.perf_counter()
        try:
            return await call
        finally:
            opened.timings.append((name, time.perf_counter() - t0))

    try:
        opened.claimed = await timed("claim", plane.claim(node, want, ttl_s))
        if not opened.claimed:
            return opened
        slack = await timed("snapshot", plane.snapshot(node))
        opened.fits = fit_to_slack(opened.claimed, slack, block_size)
        fits, rest = opened.claimed[: opened.fits], opened.claimed[opened.fits :]
        if rest:
            await timed("unclaim", plane.unclaim(node, rest))
        outcomes = await timed("reserve", plane.reserve_many(node, fits))
        opened.leased, opened.refused = split_outcomes(fits, outcomes)
        opened.applied = await timed(
            "start", plane.start_many(node, opened.leased, opened.refused, ttl_s)
        )
        return opened
    finally:
        await plane.drop(node)


class BackfillPlane:
    """Backfill's own calls: the ``Repository`` in threads, the ``AsyncLedger``. Claims are
    open claims as the worker's: ``claim`` opens one per node (its items locked, unwritten),
    ``unclaim`` leaves items in the queue (no write), ``start_many`` starts the leased and
    holds the refused in one statement and commits, ``drop`` ends a claim writing nothing.

    With ``claim_ledger`` (the synchronous ``Ledger`` on the same namespace) a claim's window,
    from ``open_claim`` to ``start_claim``, runs in one thread: the same calls in the same
    order, but the transaction no longer waits on the harness loop between them. On a fleet each
    node's loop is its own and nearly idle between claims; here a thousand nodes share one, and
    each ``await`` inside the window waited a whole turn of it (reserve p50 148 ms at 1,000
    nodes), which held the claim's transaction, and its pooled connection, that long."""

    def __init__(
        self,
        repo: Repository,
        ledger: AsyncLedger,
        cfg: NodeConfig,
        listen_ledger: AsyncLedger | None = None,
        open_limit: int = 4,
        claim_ledger: Ledger | None = None,
    ) -> None:
        self.repo, self.ledger, self.cfg = repo, ledger, cfg
        self.claim_ledger = claim_ledger
        self._open: dict[str, OpenClaim] = {}
        # An open claim holds a pooled connection until its node starts it, which takes a
        # thread. A real node has a connection of its own; here the simulated nodes share a
        # pool, and with every connection held by open claims and every thread waiting in
        # another open_claim for one, no claim could start (measured: 1,000 nodes, 0 items/s,
        # the claims ended by their idle bound). So at most ``open_limit`` are open at once,
        # fewer than the pool's connections.
        self._open_slots = asyncio.Semaphore(open_limit)
        # Each subscription holds a connection: not from the calls' bounded pool.
        self.listen_ledger = listen_ledger or ledger

    @property
    def client(self) -> AsyncRedis:
        return self.ledger.client

    @property
    def keys(self) -> LedgerKeys:
        return self.ledger.keys

    async def snapshot(self, node: str) -> int:
        snap = await self.ledger.snapshot(node)
        return 0 if snap is None or not snap.ready else snap.slack

    async def claim_to_start(self, node: str, want: int, ttl_s: float, block_size: int) -> Opened:
        if self.claim_ledger is None:
            return await claim_to_start(self, node, want, ttl_s, block_size)
        await self.drop(node)
        async with self._open_slots:
            return await asyncio.to_thread(
                self._claim_to_start_blocking, self.claim_ledger, node, want, ttl_s, block_size
            )

    def _claim_to_start_blocking(
        self, ledger: Ledger, node: str, want: int, ttl_s: float, block_size: int
    ) -> Opened:
        opened = Opened()

        def timed(name: str, call: Callable[[], T]) -> T:
            t0 = time.perf_counter()
            try:
                return call()
            finally:
                opened.timings.append((name, time.perf_counter() - t0))

        claim = timed("claim", lambda: self.repo.claims.open_claim(node, want, ttl_s))
        try:
            opened.claimed = [_held(c) for c in claim.items]
            if not claim.open or not opened.claimed:
                return opened
            snap = timed("snapshot", lambda: ledger.snapshot(node))
            slack = 0 if snap is None or not snap.ready else snap.slack
            opened.fits = fit_to_slack(opened.claimed, slack, block_size)
            fits = opened.claimed[: opened.fits]
            requests = self._reserve_requests(node, fits)
            try:
                outcomes: list[Any] = list(timed("reserve", lambda: ledger.reserve_many(requests)))
            except PartialBatchError as exc:
                outcomes = list(exc.results)
            opened.leased, opened.refused = split_outcomes(fits, outcomes)
            starts = _starts(opened.leased)
            held = [(h.item_id, h.attempt) for h in opened.refused]
            opened.applied = set(
                timed("start", lambda: self.repo.claims.start_claim(claim, starts, held))
            )
            return opened
        finally:
            if claim.open:
                with contextlib.suppress(BackfillError):
                    self.repo.claims.drop_claim(claim)

    async def claim(self, node: str, want: int, ttl_s: float) -> list[Held]:
        await self.drop(node)
        await self._open_slots.acquire()
        try:
            claim = await asyncio.to_thread(self.repo.claims.open_claim, node, want, ttl_s)
        except BaseException:
            self._open_slots.release()
            raise
        if claim.open:
            self._open[node] = claim
        else:
            self._open_slots.release()
        return [_held(c) for c in claim.items]

    async def unclaim(self, node: str, held: Sequence[Held]) -> None:
        """Left in the queue by the open claim: nothing to write."""

    async def drop(self, node: str) -> None:
        claim = self._open.pop(node, None)
        if claim is not None:
            try:
                with contextlib.suppress(BackfillError):
                    await asyncio.to_thread(self.repo.claims.drop_claim, claim)
            finally:
                self._open_slots.release()

    def _reserve_requests(self, node: str, held: Sequence[Held]) -> list[ReserveRequest]:
        return [
            ReserveRequest(
                node=node,
                service_class=ServiceClass.BATCH,
                prompt_tokens=h.prompt_tokens,
                max_output_tokens=h.max_output_tokens,
                n=1,
                owner=f"{node}/{h.item_id}/{h.attempt}",
                preemptible=True,
                deadline_ms=h.deadline_ms,
                ttl_ms=int(self.cfg.lease_ttl_s * 1000),
            )
            for h in held
        ]

    async def reserve_many(self, node: str, held: Sequence[Held]) -> list[Any]:
        requests = self._reserve_requests(node, held)
        try:
            return list(await self.ledger.reserve_many(requests))
        except PartialBatchError as exc:
            return list(exc.results)

    async def give_back(self, held: Held) -> None:
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(
                self.repo.items.give_back,
                held.item_id,
                held.attempt,
                ItemState.DEFERRED,
                retry_after_s=1.0,
                detail="no slack",
            )

    async def start_many(
        self, node: str, leased: Sequence[Held], refused: Sequence[Held], ttl_s: float
    ) -> set[int]:
        claim = self._open.pop(node, None)
        if claim is None:
            return set()
        starts = _starts(leased)
        held = [(h.item_id, h.attempt) for h in refused]
        try:
            return set(await asyncio.to_thread(self.repo.claims.start_claim, claim, starts, held))
        finally:
            self._open_slots.release()

    async def settle(self, node: str, held: Held, generated: int) -> None:
        with contextlib.suppress(BackfillError):
            await self.ledger.settle(node, held.lease.lease_id, held.lease.fencing_token, generated)

    async def settle_many(self, node: str, progress: Sequence[tuple[Held, int]]) -> None:
        with contextlib.suppress(BackfillError):
            await self.ledger.settle_many(
                node, [(h.lease.lease_id, h.lease.fencing_token, g) for h, g in progress]
            )

    async def heartbeat_claims(self, held: Sequence[Held], ttl_s: float) -> set[int]:
        return set(
            await asyncio.to_thread(
                self.repo.claims.heartbeat, [(h.item_id, h.attempt) for h in held], ttl_s
            )
        )

    async def heartbeat_leases(self, node: str, held: Sequence[Held], ttl_s: float) -> None:
        with contextlib.suppress(BackfillError):
            await self.ledger.heartbeat_many(
                node,
                [(h.lease.lease_id, h.lease.fencing_token) for h in held],
                ttl_ms=int(ttl_s * 1000),
            )

    async def finish(self, done: Sequence[tuple[Held, int]]) -> set[int]:
        fins = [
            Finish(
                h.item_id,
                h.attempt,
                h.lease.fencing_token,
                ItemState.SUCCEEDED,
                result=RESULT,
                output_tokens=out,
                prompt_tokens=h.prompt_tokens,
            )
            for h, out in done
        ]
        return set(await asyncio.to_thread(self.repo.items.finish, fins))

    async def release(self, held: Sequence[Held]) -> None:
        with contextlib.suppress(BackfillError):
            await self.ledger.release_many([h.lease for h in held])

    async def observe(self, node: str) -> None:
        await self.ledger.snapshot(node)
        await self.ledger.observe(node, 0)

    async def listen(self, node: str) -> None:
        async with await self.listen_ledger.listen_preemptions(node) as listener:
            async for _ in listener:
                pass


def _held(c: ClaimedItem) -> Held:
    return Held(
        c.id,
        c.attempt,
        c.prompt_tokens or 0,
        c.max_output_tokens,
        int(c.deadline.timestamp() * 1000),
    )


def _starts(leased: Sequence[Held]) -> list[Start]:
    return [
        Start(
            h.item_id,
            h.attempt,
            h.lease.lease_id,
            h.lease.fencing_token,
            h.lease.tokens,
            h.prompt_tokens,
        )
        for h in leased
    ]
