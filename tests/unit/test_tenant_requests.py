"""A tenant's requests beyond its bound queue in its own line, first come first served, and a
freed place goes straight to that tenant's next one; other tenants never queue behind it."""

from __future__ import annotations

import asyncio

import pytest

from backfill.tenant_requests import TenantRequests, TooManyRequestsInProgress
from queue_api.tenant_turns import TenantTurns


def test_beyond_the_bound_a_tenant_queues_alone_and_freed_places_go_in_order() -> None:
    turns: TenantRequests[str] = TenantRequests(2)
    assert turns.enter("A", "a1")
    assert turns.enter("A", "a2")
    assert not turns.enter("A", "a3")
    assert not turns.enter("A", "a4")
    # B is not behind A's queue.
    assert turns.enter("B", "b1")
    assert (turns.in_progress("A"), turns.waiting("A"), turns.in_progress("B")) == (2, 2, 1)
    # A place freed goes to A's first waiter, the count unchanged.
    assert turns.leave("A") == "a3"
    assert (turns.in_progress("A"), turns.waiting("A")) == (2, 1)
    # A newcomer does not jump the queue even when a place is about to free.
    assert not turns.enter("A", "a5")
    assert turns.abandon("A", "a4")
    assert not turns.abandon("A", "a4")
    assert turns.leave("A") == "a5"
    assert turns.leave("A") is None
    assert turns.leave("A") is None
    assert turns.in_progress("A") == 0
    assert turns.waiting("A") == 0
    assert turns.leave("B") is None


def test_the_refusal_names_the_bound_and_says_when_to_retry() -> None:
    refusal = TenantRequests[str](4).refusal(2.0)
    assert isinstance(refusal, TooManyRequestsInProgress)
    assert refusal.code == "too_many_requests_in_progress"
    assert "at most 4 at once" in refusal.message
    assert "BACKFILL_TENANT_REQUESTS_IN_PROGRESS" in refusal.message
    assert refusal.retry_after_s == 1.0


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="bound"):
        TenantRequests[str](0)


def test_on_the_loop_a_waiter_gets_a_freed_place_or_a_429_after_its_wait() -> None:
    async def scenario() -> None:
        turns = TenantTurns(1, wait_s=0.3)
        await turns.wait_for_turn("A")
        # A's second waits; B goes straight in.
        second = asyncio.create_task(turns.wait_for_turn("A"))
        await asyncio.sleep(0.05)
        assert not second.done()
        await asyncio.wait_for(turns.wait_for_turn("B"), 0.1)
        turns.done("A")
        await asyncio.wait_for(second, 0.1)
        # Nobody leaves: the third is refused after its wait, and its place is not leaked.
        with pytest.raises(TooManyRequestsInProgress):
            await turns.wait_for_turn("A")
        assert turns.requests.waiting("A") == 0
        # A waiter cancelled (client gone) leaves no trace either.
        fourth = asyncio.create_task(turns.wait_for_turn("A"))
        await asyncio.sleep(0.05)
        fourth.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fourth
        assert turns.requests.waiting("A") == 0
        turns.done("A")
        turns.done("B")
        assert turns.requests.in_progress("A") == 0 == turns.requests.in_progress("B")

    asyncio.run(scenario())
