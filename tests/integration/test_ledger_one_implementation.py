"""Each ledger operation is written once and driven by both ledgers: the asyncio ledger's
rebuild, counters and pool list leave and read Redis exactly as the synchronous one's do (on
one Redis server and on a Redis Cluster)."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio

from backfill.keys import FENCE_EPOCH_SHIFT
from backfill.ledger import ActiveLease, AsyncLedger, Lease, Ledger, NodePool
from backfill.policy import ServiceClass
from tests.integration.test_ledger import T0, at, dump
from tests.support_policy import pool_policy

POLICY = pool_policy(8192, 8192, 2000, 256, 0)
NODES = [NodePool("n1", 10_000, 16), NodePool("n2", 20_000, 16, interactive_reserve_tokens=500)]
LIVE = [
    ActiveLease(
        "ls_a",
        "n1",
        320,
        3 * FENCE_EPOCH_SHIFT + 5,
        at(T0 + 60_000),
        owner="w1",
        generated_tokens=12,
        started_at=at(T0),
    ),
    ActiveLease("ls_b", "n2", 160, 3 * FENCE_EPOCH_SHIFT + 6, at(T0 + 60_000), preemptible=False),
]


@pytest.fixture
def two_namespaces(ledger_client: redis.Redis) -> Iterator[tuple[str, str]]:
    names = (f"bf-test-{secrets.token_hex(4)}", f"bf-test-{secrets.token_hex(4)}")
    yield names
    for ns in names:
        for key in ledger_client.scan_iter(match=f"{ns}:*"):
            ledger_client.delete(key)


def without_namespace(state: dict[bytes, Any], namespace: str) -> dict[bytes, Any]:
    return {k.replace(namespace.encode(), b"NS"): v for k, v in state.items()}


def test_both_ledgers_rebuild_to_the_same_redis_state(
    ledger_client: redis.Redis, two_namespaces: tuple[str, str], ledger_redis_url: str
) -> None:
    sync_ns, async_ns = two_namespaces
    sync_report = Ledger(ledger_client, sync_ns, POLICY).rebuild(NODES, LIVE, 2, now_ms=T0)

    async def rebuild_async() -> Any:
        ledger = AsyncLedger.from_url(ledger_redis_url, async_ns, POLICY)
        try:
            report = await ledger.rebuild(NODES, LIVE, 2, now_ms=T0)
            return (
                report,
                await ledger.nodes(),
                await ledger.counters("n1"),
                await ledger.is_ready(),
            )
        finally:
            await ledger.aclose()

    async_report, async_nodes, async_counters, async_ready = asyncio.run(rebuild_async())
    assert sync_report == async_report
    assert sync_report.epoch == 4  # past the epoch of every fencing token seen
    assert sync_report.restored == 2
    assert without_namespace(dump(ledger_client, sync_ns), sync_ns) == without_namespace(
        dump(ledger_client, async_ns), async_ns
    )
    sync_ledger = Ledger(ledger_client, sync_ns, POLICY)
    assert async_nodes == sync_ledger.nodes() == ["n1", "n2"]
    assert async_counters == sync_ledger.counters("n1")
    assert async_ready
    assert sync_ledger.is_ready()


def test_an_operation_keeps_its_signature_and_doc_on_both_ledgers(
    ledger_client: redis.Redis, two_namespaces: tuple[str, str]
) -> None:
    ledger = Ledger(ledger_client, two_namespaces[0], POLICY)
    ledger.rebuild(NODES, [], 1, now_ms=T0)
    lease = ledger.reserve("n1", ServiceClass.BATCH, 10, 10, lease_id="ls_doc", now_ms=T0)
    assert isinstance(lease, Lease)
    assert lease.lease_id == "ls_doc"
    assert Ledger.reserve.__doc__ == AsyncLedger.reserve.__doc__
    assert ledger.reserve.__doc__ is not None
    assert ledger.reserve.__doc__.startswith("Reserve on ``node``")
