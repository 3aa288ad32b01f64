"""The gateway's admission loop against a real Redis ledger: routing among nodes by free
interactive room, preemption of batch where that makes room, bounded waiting, and the
refusals (no room, ledger rebuilding, never fits)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import redis

from backfill.errors import BackfillError
from backfill.gateway.placement import Admission, AdmissionTiming, admit
from backfill.gateway.refusals import (
    ClientGone,
    GatewayUnavailable,
    NoInteractiveRoom,
    ReservationTooLarge,
)
from backfill.gateway.sizing import Sizing
from backfill.ledger import AsyncLedger, Lease, Ledger, NodePool
from backfill.policy import ClassLimits, PoolPolicy, ServiceClass
from tests.conftest import REDIS_URL

T = TypeVar("T")
POLICY = PoolPolicy(
    interactive=ClassLimits(4096), batch=ClassLimits(4096), interactive_reserve_tokens=1024
)
BLOCK = 16
FAST = AdmissionTiming(first_backoff_s=0.01, max_backoff_s=0.05)


def run(scenario: Callable[[AsyncLedger], Awaitable[T]], namespace: str) -> T:
    async def main() -> T:
        ledger = AsyncLedger.from_url(REDIS_URL, namespace, POLICY)
        try:
            return await scenario(ledger)
        finally:
            await ledger.aclose()

    return asyncio.run(main())


@pytest.fixture
def ledger(redis_namespace: str) -> Ledger:
    sync = Ledger(redis.Redis.from_url(REDIS_URL), redis_namespace, POLICY)
    sync.rebuild([NodePool("a", 4096, BLOCK), NodePool("b", 4096, BLOCK)], [], epoch=1)
    return sync


def sizing(prompt: int = 100, output: int = 412, sequences: int = 1) -> Sizing:
    return Sizing(prompt, output, sequences, output_defaulted=False)


def go(
    namespace: str, nodes: list[str], size: Sizing, max_wait_s: float = 0.0, **kw: object
) -> Admission:
    async def scenario(al: AsyncLedger) -> Admission:
        return await admit(
            al,
            nodes,
            size,
            lease_id=f"gw_{time.monotonic_ns()}",
            owner="test",
            ttl_ms=10_000,
            max_wait_s=max_wait_s,
            timing=FAST,
            **kw,  # type: ignore[arg-type]
        )

    return run(scenario, namespace)


def test_routes_to_the_node_with_room_without_preempting(
    ledger: Ledger, redis_namespace: str
) -> None:
    assert isinstance(ledger.reserve("a", ServiceClass.INTERACTIVE, 0, 3500), Lease)
    admitted = go(redis_namespace, ["a", "b"], sizing())
    assert admitted.lease.node == "b"
    assert admitted.lease.preempted == ()


def test_prefers_the_less_pressed_node_when_both_fit(ledger: Ledger, redis_namespace: str) -> None:
    assert isinstance(ledger.reserve("b", ServiceClass.BATCH, 0, 2000), Lease)
    assert go(redis_namespace, ["b", "a"], sizing()).lease.node == "a"
    # The engine saw non-batch use on a that bypassed the gateway: a is now the pressed one.
    ledger.observe("a", 3000)
    assert go(redis_namespace, ["a", "b"], sizing()).lease.node == "b"


def test_preempts_batch_where_that_makes_room(ledger: Ledger, redis_namespace: str) -> None:
    victim = ledger.reserve("a", ServiceClass.BATCH, 100, 2900)
    assert isinstance(victim, Lease)
    assert isinstance(ledger.reserve("b", ServiceClass.INTERACTIVE, 0, 4000), Lease)
    admitted = go(redis_namespace, ["b", "a"], sizing(sequences=3))
    assert admitted.lease.node == "a"
    assert admitted.lease.preempted == (victim.lease_id,)


def test_waits_for_room_within_the_budget_then_refuses(
    ledger: Ledger, redis_namespace: str
) -> None:
    held = ledger.reserve("a", ServiceClass.INTERACTIVE, 0, 4000)
    assert isinstance(held, Lease)
    started = time.monotonic()
    with pytest.raises(NoInteractiveRoom) as caught:
        go(redis_namespace, ["a"], sizing(), max_wait_s=0.3)
    assert 0.3 <= time.monotonic() - started < 1.5
    assert caught.value.retry_after_s is not None
    assert caught.value.retry_after_s >= 1

    async def release_later(al: AsyncLedger) -> Admission:
        async def release() -> None:
            await asyncio.sleep(0.3)
            await al.release(held)

        releaser = asyncio.create_task(release())
        admitted = await admit(
            al, ["a"], sizing(), lease_id="gw_wait", owner="t", ttl_ms=10_000,
            max_wait_s=5.0, timing=FAST,
        )  # fmt: skip
        await releaser
        return admitted

    admitted = run(release_later, redis_namespace)
    assert admitted.waited_s >= 0.25
    assert admitted.attempts > 1


def test_a_caller_that_leaves_while_waiting_gets_nothing_reserved(
    ledger: Ledger, redis_namespace: str
) -> None:
    assert isinstance(ledger.reserve("a", ServiceClass.INTERACTIVE, 0, 4000), Lease)

    async def gone() -> bool:
        return True

    with pytest.raises(ClientGone):
        go(redis_namespace, ["a"], sizing(), max_wait_s=5.0, disconnected=gone)
    snap = ledger.snapshot("a")
    assert snap is not None
    assert snap.interactive_in_use == 4000


def test_what_no_pool_could_hold_is_refused_at_once(ledger: Ledger, redis_namespace: str) -> None:
    with pytest.raises(ReservationTooLarge):
        go(redis_namespace, ["a", "b"], sizing(sequences=10), max_wait_s=5.0)


def test_a_rebuilding_ledger_admits_within_the_reserve_only(
    ledger: Ledger, redis_namespace: str, redis_client: redis.Redis
) -> None:
    redis_client.delete(ledger.keys.node("a").ready)
    assert go(redis_namespace, ["a"], sizing()).lease.tokens == 512
    with pytest.raises(GatewayUnavailable) as caught:
        go(redis_namespace, ["a"], sizing(sequences=2))
    assert "ledger_rebuilding" in caught.value.message


def test_no_nodes_is_unavailable(redis_namespace: str) -> None:
    with pytest.raises(GatewayUnavailable):
        go(redis_namespace, [], sizing())


def test_an_unknown_node_is_skipped(ledger: Ledger, redis_namespace: str) -> None:
    admitted = go(redis_namespace, ["ghost", "a"], sizing())
    assert admitted.lease.node == "a"
    with pytest.raises(BackfillError):
        go(redis_namespace, ["ghost"], sizing())
