"""Keeping an admitted interactive lease: heartbeats while its request runs, the progress it
made, the exact count of a bound admission, and one settle-and-release however it ends."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any, Protocol

from backfill.errors import BackfillError, LedgerError
from backfill.gateway.placement import Admission
from backfill.gateway.sizing import Sizing
from backfill.ledger import AsyncLedger, Lease, LeaseStatus

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


class LeaseKeeper:
    """Heartbeats an admitted lease while its request runs, records progress, and settles and
    releases it exactly once."""

    def __init__(
        self,
        ledger: AsyncLedger,
        lease: Lease,
        interval_s: float,
        ttl_ms: int,
        events: AdmissionEvents | None = None,
    ) -> None:
        self.ledger = ledger
        self.lease = lease
        self.generated = 0
        self._interval_s = interval_s
        self._ttl_ms = ttl_ms
        self._events = events or NoEvents()
        self._ended = False
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        self.exact: Sizing | None = None
        """The sizing on the engine's count, once known, of a request admitted on a bound."""
        self._count: Callable[[], Awaitable[None]] | None = None
        self._counting: asyncio.Task[None] | None = None

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

    async def _heartbeat(self) -> None:
        lease = self.lease
        lost = closed = False
        while True:
            await asyncio.sleep(self._interval_s)
            self.start_counting()
            try:
                if lost:
                    if not closed:
                        closed = await self._close_node()
                    lost = not await self._restore()
                    if lost:
                        continue
                    closed = False
                beat = await self.ledger.heartbeat(
                    lease.node, lease.lease_id, lease.fencing_token, ttl_ms=self._ttl_ms
                )
                if beat.status is LeaseStatus.UNKNOWN:
                    lost = True
                    closed = await self._close_node()
                    continue
                if not beat.ok:
                    log.warning("interactive lease %s: heartbeat %s", lease.lease_id, beat.status)
                    return
                await self.ledger.settle(
                    lease.node, lease.lease_id, lease.fencing_token, self.generated
                )
            except BackfillError as exc:
                log.warning("interactive lease %s: heartbeat failed: %s", lease.lease_id, exc)

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
                ttl_ms=self._ttl_ms,
                now_ms=time.time_ns() // 1_000_000,
            )
        except LedgerError:
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
        self._beat.cancel()
        lease = self.lease
        self._events.lease_ended(used_tokens)
        try:
            if used_tokens is not None:
                await self.ledger.settle(
                    lease.node,
                    lease.lease_id,
                    lease.fencing_token,
                    self.generated,
                    reservation_tokens=max(1, used_tokens),
                )
            await self.ledger.release(lease)
        except BackfillError as exc:
            # The lease expires on its own within the TTL.
            log.warning("interactive lease %s not released: %s", lease.lease_id, exc)
