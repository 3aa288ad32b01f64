"""Keeping an admitted interactive lease: heartbeats while its request runs, the progress it
made, the exact count of a bound admission, and one settle-and-release however it ends."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from backfill.cancelling import cancel_and_wait
from backfill.errors import BackfillError
from backfill.gateway.placement import Admission
from backfill.gateway.sizing import Sizing
from backfill.ledger import HeartbeatResult, InteractiveLedger, Lease, LeaseStatus

log = logging.getLogger("backfill.gateway")


class AdmissionEvents(Protocol):
    """What admission tells whoever counts it (the API's metrics); the core keeps no
    counters."""

    def admitted(self, admission: Admission, *, bounded: bool) -> None:
        """A request holds a lease now (admitted on its prompt's bound, or counted)."""
        ...

    def lease_ended(self, used_tokens: int | None) -> None:
        """A request's lease was given back, with the KV tokens it used when known."""
        ...

    def bound_violated(self) -> None:
        """A prompt had more tokens than the bound it was admitted on."""
        ...


class NoEvents:
    """Admission counted by no one."""

    def admitted(self, admission: Admission, *, bounded: bool) -> None:
        pass

    def lease_ended(self, used_tokens: int | None) -> None:
        pass

    def bound_violated(self) -> None:
        pass


def used_tokens(sizing: Sizing, usage: Mapping[str, Any] | None, completion: int) -> int:
    """KV tokens the request held at its largest, per the engine's usage when it sent one."""
    prompt = sizing.prompt_tokens
    if usage is not None:
        completion = int(usage.get("completion_tokens") or completion)
    return sizing.sequences * prompt + completion


class LeaseBeats:
    """Keeps every live interactive lease of one gateway process: each interval, one
    pipelined heartbeat and one pipelined settle per node for all of its leases (as a worker
    beats its node's batch leases), not two round trips per lease. A lease is first beaten one
    interval after its admission, not beside its prefill."""

    def __init__(self, ledger: InteractiveLedger, interval_s: float, ttl_ms: int) -> None:
        self.ledger = ledger
        self.interval_s = interval_s
        self.ttl_ms = ttl_ms
        self._keepers: dict[str, LeaseKeeper] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, keeper: LeaseKeeper) -> None:
        self._keepers[keeper.lease.lease_id] = keeper
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, keeper: LeaseKeeper) -> None:
        self._keepers.pop(keeper.lease.lease_id, None)

    def __len__(self) -> int:
        return len(self._keepers)

    async def aclose(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])  # again if a cancellation was lost

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.beat()
            except Exception:  # a round that failed is the next round's to try again
                log.exception("interactive heartbeats: a round failed")

    async def beat(self) -> None:
        """One round: every lease admitted at least an interval ago, by node."""
        due = time.monotonic() - self.interval_s
        by_node: dict[str, list[LeaseKeeper]] = {}
        for keeper in list(self._keepers.values()):
            if keeper.beating and keeper.admitted_s <= due:
                by_node.setdefault(keeper.lease.node, []).append(keeper)
        await asyncio.gather(*(self._beat_node(n, ks) for n, ks in by_node.items()))

    async def _beat_node(self, node: str, keepers: list[LeaseKeeper]) -> None:
        for keeper in keepers:
            keeper.start_counting()
        try:
            beats = await self.ledger.heartbeat_many(
                node,
                [(k.lease.lease_id, k.lease.fencing_token) for k in keepers],
                ttl_ms=self.ttl_ms,
            )
        except BackfillError as exc:
            log.warning("node %s: interactive heartbeats failed: %s", node, exc)
            return
        live = [k for k, b in zip(keepers, beats, strict=True) if k.heard(b)]
        if not live:
            return
        try:
            await self.ledger.settle_many(
                node, [(k.lease.lease_id, k.lease.fencing_token, k.generated) for k in live]
            )
        except BackfillError as exc:
            log.warning("node %s: interactive progress not settled: %s", node, exc)


RELEASE_RETRY_PAUSES_S = (0.2, 1.0)
"""Pauses before a failed interactive release is tried again (then the TTL frees it)."""


class LeaseKeeper:
    """An admitted lease while its request runs: kept alive by its process's
    :class:`LeaseBeats`, its progress recorded, restored if the ledger loses it, settled and
    released exactly once."""

    def __init__(
        self,
        lease: Lease,
        beats: LeaseBeats,
        events: AdmissionEvents | None = None,
    ) -> None:
        self.ledger = beats.ledger
        self.lease = lease
        self.generated = 0
        self.admitted_s = time.monotonic()
        self._beats = beats
        self._events = events or NoEvents()
        self._ended = False
        self._stopped = False
        self._recovery: asyncio.Task[None] | None = None
        self.exact: Sizing | None = None
        """The sizing on the engine's count, once known, of a request admitted on a bound."""
        self._count: Callable[[], Awaitable[None]] | None = None
        self._counting: asyncio.Task[None] | None = None
        beats.add(self)

    @property
    def beating(self) -> bool:
        """Whether the round's heartbeat is for it: live, known to the ledger, not stopped."""
        return not (self._ended or self._stopped or self._recovery is not None)

    def heard(self, beat: HeartbeatResult | BackfillError) -> bool:
        """Take the round's answer for this lease; whether it is still held (to settle)."""
        lease = self.lease
        if isinstance(beat, BackfillError):
            log.warning("interactive lease %s: heartbeat failed: %s", lease.lease_id, beat)
            return False
        if beat.status is LeaseStatus.UNKNOWN:
            self._recovery = asyncio.get_running_loop().create_task(self._recover())
            return False
        if not beat.ok:
            log.warning("interactive lease %s: heartbeat %s", lease.lease_id, beat.status)
            self._stopped = True
            return False
        return True

    def count_later(self, count: Callable[[], Awaitable[None]]) -> None:
        """Run ``count`` (the exact count of a bound admission) after the first token or the
        first heartbeat, whichever comes first: not beside the request's prefill, whose
        engine it would slow."""
        self._count = count

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def bounded(self) -> bool:
        """Admitted on a bound of its prompt, not the engine's count."""
        return self._count is not None

    def start_counting(self) -> None:
        if self._count is not None and self._counting is None and not self._ended:
            self._counting = asyncio.ensure_future(self._count())

    def check_bound(self, sizing: Sizing, usage: Mapping[str, Any] | None) -> None:
        """A bound admission whose single prompt the engine's usage counts above the bound is
        logged and counted (the exact count, when it ran first, has said so already)."""
        if self._ended or not self.bounded or usage is None or sizing.sequences != 1:
            return
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int) and prompt > sizing.prompt_tokens and self.exact is None:
            self._events.bound_violated()
            log.error(
                "interactive lease %s: the prompt had %s tokens, over its bound of %s",
                self.lease.lease_id,
                prompt,
                sizing.prompt_tokens,
            )

    async def settle_reservation(self, tokens: int) -> None:
        """Shrink the reservation to ``tokens`` (the exact need of a bound admission)."""
        if self._ended:
            return
        await self._settle(tokens)

    async def _settle(self, tokens: int) -> None:
        """Shrink the reservation to ``tokens``; a ledger error is logged, not raised."""
        lease = self.lease
        try:
            await self.ledger.settle(
                lease.node,
                lease.lease_id,
                lease.fencing_token,
                self.generated,
                reservation_tokens=tokens,
            )
        except BackfillError as exc:
            log.warning("interactive lease %s not settled: %s", lease.lease_id, exc)

    async def _recover(self) -> None:
        """Close the node and put the lease back once the rebuild has begun; then the
        round's heartbeats take it again."""
        closed = False
        try:
            while not self._ended:
                if not closed:
                    closed = await self._close_node()
                if await self._restore():
                    break
                await asyncio.sleep(self._beats.interval_s)
        finally:
            self._recovery = None

    async def _close_node(self) -> bool:
        """The ledger has no trace of this lease while its request runs: Redis lost writes
        (a restart, or a replica promoted before a write reached it). Interactive leases are
        not in Postgres, so no rebuild brings it back: the node is closed to batch until the
        next rebuild (as a worker closes it for a lost batch lease), and :meth:`_restore` puts
        the lease back once the rebuild has given the node a new epoch."""
        lease = self.lease
        try:
            closed = await self.ledger.mark_incomplete(lease.node)
        except BackfillError as exc:
            log.warning("node %s: could not close for a rebuild: %s", lease.node, exc)
            return False
        log.warning(
            "interactive lease %s is missing from the ledger of node %s%s; restored after the "
            "node's rebuild",
            lease.lease_id,
            lease.node,
            "; batch closed on the node until then" if closed else "",
        )
        return True

    async def _restore(self) -> bool:
        """Put the lost lease back; False until the rebuild has begun (the ledger refuses a
        fencing token of the node's current epoch)."""
        lease = self.lease
        try:
            restored = await self.ledger.restore_lease(
                replace(lease, generated_tokens=self.generated),
                ttl_ms=self._beats.ttl_ms,
                now_ms=time.time_ns() // 1_000_000,
            )
        except BackfillError:  # refused until the rebuild's new epoch, or Redis is away
            return False
        log.info(
            "interactive lease %s %s in the ledger of node %s",
            lease.lease_id,
            "restored" if restored else "found again",
            lease.node,
        )
        return True

    async def end(self, used_tokens: int | None) -> None:
        """Settle with the tokens used (when known) and release; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        self._beats.discard(self)
        if self._recovery is not None:
            self._recovery.cancel()
        lease = self.lease
        self._events.lease_ended(used_tokens)
        if used_tokens is not None:
            await self._settle(max(1, used_tokens))
        # The room goes back now: a release lost to a slow Redis answer (a starved machine)
        # is tried again, and failing that the lease, no longer beaten, expires within its
        # TTL and the next reap frees it.
        for pause_s in (*RELEASE_RETRY_PAUSES_S, None):
            try:
                await self.ledger.release(lease)
                return
            except BackfillError as exc:
                if pause_s is None:
                    log.warning("interactive lease %s not released: %s", lease.lease_id, exc)
                    return
                await asyncio.sleep(pause_s)
