"""A job's items are claimed when they become claimable, not at the idle claim loop's next
poll: the create rings the work bell (``backfill.work_bell``) and the node's idle dispatcher,
listening, claims at once.

Real Postgres and Redis, the real create path (``backfill.batches.create_batch``), a
dispatcher beside a stand-in engine whose idle poll is far longer than the bound asserted.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import redis
from batch_api_support import chat_file

from backfill import batches
from backfill.config import Settings
from backfill.keys import LedgerKeys
from backfill.states import ItemState
from backfill.store import Repository
from backfill.work_bell import WorkBell
from tests.integration.standin_engine import StandInEngine, quick_dispatcher, stand_in_node

BLOCK = 16
IDLE_POLL_S = 30.0
"""The dispatcher's idle poll: without a ring, a new job waits this long for its claim."""
CLAIMED_WITHIN_S = 10.0
"""Only a failure's bound (a third of the poll): a rung claim takes a few hundredths."""


def _create(repo: Repository, settings: Settings, model: str) -> str:
    tenant = repo.tenants.create_tenant(f"bell-{secrets.token_hex(3)}")
    upload = batches.upload_file(
        repo,
        settings,
        tenant.id,
        filename="in.jsonl",
        purpose="batch",
        content=chat_file(2, model=model),
    )
    request = batches.BatchRequest(upload.id, "/v1/chat/completions", "24h")
    return batches.create_batch(repo, settings, tenant, request).id


def _subscribers(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.redis_url)
    try:
        channel = LedgerKeys(settings.redis_namespace).claimable_channel()
        return int(dict(client.pubsub_numsub(channel)).get(channel.encode(), 0))
    finally:
        client.close()


def test_a_new_jobs_items_are_claimed_when_it_is_created_not_at_the_next_idle_poll(
    settings: Settings,
) -> None:
    """Red before: the idle dispatcher slept its poll out (30 s) before it claimed."""
    node = "n-bell"
    engine = StandInEngine(blocks=64, block=BLOCK)
    with stand_in_node(settings, node, BLOCK) as (repo, _ledger, aledger):
        dispatcher = quick_dispatcher(node, engine, repo, aledger, BLOCK, idle_poll_s=IDLE_POLL_S)

        async def main() -> float | None:
            runner = asyncio.create_task(dispatcher.run())
            try:
                # Listening (when it listens), and past its first claim, which found nothing.
                for _ in range(40):
                    if await asyncio.to_thread(_subscribers, settings):
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5)
                job_id = await asyncio.to_thread(_create, repo, settings, "m")
                created = time.monotonic()
                while time.monotonic() - created < CLAIMED_WITHIN_S:
                    counts = await asyncio.to_thread(repo.stats.counted_states, job_id)
                    if counts.get(ItemState.QUEUED, 0) < 2:
                        return time.monotonic() - created
                    await asyncio.sleep(0.05)
                return None
            finally:
                dispatcher.stop()
                await asyncio.wait({runner}, timeout=30)
                await aledger.aclose()

        claimed_after = asyncio.run(main())
    assert claimed_after is not None, (
        f"no item of the new job was claimed within {CLAIMED_WITHIN_S} s "
        f"(the idle poll is {IDLE_POLL_S} s)"
    )


def test_a_ring_reaches_listeners_and_a_bell_without_redis_goes_quiet(settings: Settings) -> None:
    """The ring names the model; a Redis that cannot be reached costs one failed try, then
    the bell stays silent (an ingest never waits on it twice in a row), and never raises."""
    bell = WorkBell(settings.redis_url, settings.redis_namespace)
    client = redis.Redis.from_url(settings.redis_url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.subscribe(LedgerKeys(settings.redis_namespace).claimable_channel())
        assert bell.ring("some-model") >= 1
        message = None
        for _ in range(20):
            message = pubsub.get_message(timeout=0.1)
            if message is not None:
                break
        assert message is not None
        assert message["data"] == b"some-model"
    finally:
        pubsub.close()
        client.close()
        bell.close()

    gone = WorkBell("redis://127.0.0.1:1/0", settings.redis_namespace)
    started = time.monotonic()
    assert gone.ring("m") == 0
    assert gone.ring("m") == 0  # silent: not tried again
    assert time.monotonic() - started < 2.0
