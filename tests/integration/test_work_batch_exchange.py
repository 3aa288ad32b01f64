"""Workers of one node tell each other, through Redis, how much of their batch waits in the
engine they share: each sees the others' counts, not its own, and a silent worker drops out.
Their work budgets are published the same way: the node's budget is their sum."""

from __future__ import annotations

import asyncio

import redis
import redis.asyncio

from backfill.keys import LedgerKeys
from backfill.work_budget import BudgetReason, WorkBudget
from backfill.work_signals import BudgetView, exchange_batch_awaiting, publish_budget, read_budget
from tests.conftest import REDIS_URL


def test_two_workers_see_each_others_batch_awaiting_and_a_silent_one_drops_out(
    redis_namespace: str,
) -> None:
    async def scenario() -> tuple[int, int, int, int]:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        keys = LedgerKeys(redis_namespace)
        try:
            a_first = await exchange_batch_awaiting(client, keys, "n1", "a", 3, 1.0, 100.0)
            b_sees = await exchange_batch_awaiting(client, keys, "n1", "b", 5, 1.0, 100.1)
            a_sees = await exchange_batch_awaiting(client, keys, "n1", "a", 2, 1.0, 100.2)
            # b says nothing more: 1 s later its count no longer counts.
            a_later = await exchange_batch_awaiting(client, keys, "n1", "a", 2, 1.0, 101.5)
            other_node = await exchange_batch_awaiting(client, keys, "n2", "c", 9, 1.0, 101.5)
            assert other_node == 0
            return a_first, b_sees, a_sees, a_later
        finally:
            await client.aclose()

    assert asyncio.run(scenario()) == (0, 3, 5, 0)


def test_a_nodes_budget_is_the_sum_of_its_workers_and_a_silent_worker_drops_out(
    redis_namespace: str,
) -> None:
    keys = LedgerKeys(redis_namespace)
    held = WorkBudget(
        2, 512, hold=True, code=BudgetReason.INTERACTIVE_WAITING, reason="waits", changed_at_s=99.0
    )
    quiet = WorkBudget(
        16, 4096, hold=False, code=BudgetReason.QUIET, reason="quiet", changed_at_s=50.0
    )

    async def publish() -> None:
        client = redis.asyncio.Redis.from_url(REDIS_URL)
        try:
            await publish_budget(client, keys, "n1", "a", BudgetView.of(held, 2, 300, 100.0), 5.0)
            await publish_budget(client, keys, "n1", "b", BudgetView.of(quiet, 9, 0, 102.0), 5.0)
            await publish_budget(client, keys, "n2", "c", BudgetView.of(quiet, 1, 0, 102.0), 5.0)
        finally:
            await client.aclose()

    asyncio.run(publish())
    sync = redis.Redis.from_url(REDIS_URL)
    try:
        both = read_budget(sync, keys, "n1", now_s=103.0)
        assert both is not None
        assert (both.workers, both.max_seqs, both.in_flight, both.hold) == (2, 18, 11, True)
        assert both.code == "interactive_waiting"
        # a stops writing: past its entry's expiry (105) only b counts.
        only_b = read_budget(sync, keys, "n1", now_s=106.0)
        assert only_b is not None
        assert (only_b.workers, only_b.max_seqs, only_b.hold) == (1, 16, False)
        assert read_budget(sync, keys, "n1", now_s=108.0) is None
        assert read_budget(sync, keys, "n3", now_s=103.0) is None
    finally:
        sync.close()
