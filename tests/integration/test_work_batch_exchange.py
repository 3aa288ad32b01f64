"""Workers of one node tell each other, through Redis, how much of their batch waits in the
engine they share: each sees the others' counts, not its own, and a silent worker drops out."""

from __future__ import annotations

import asyncio

import redis.asyncio

from backfill.keys import LedgerKeys
from backfill.work_signals import exchange_batch_awaiting
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
