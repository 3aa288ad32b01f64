"""Reserve + release pairs through the Ledger vs raw EVALSHA of minimal scripts, same run.

The peer is the building block itself: a minimal reserve script (bump a counter, record the
lease) and a minimal release (drop the lease, lower the counter), called with bare EVALSHA.
Backfill's path is ``Ledger.reserve``/``release``: argument validation, reclaiming expired
leases, the class limit and slack formula, fencing tokens, expiry index, ended-lease record,
typed results. Sequential: one round trip per call on both sides. Batches of 100: the raw side
pipelines 100 EVALSHAs; the Ledger sends ``reserve_many``/``release_many``, which is one
EVALSHA per node for the whole batch (the script decides the requests one after another,
atomically) — the API a worker uses. Also: single admission latency."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

import redis

from backfill.config import get_settings
from backfill.ledger import Lease, Ledger, NodePool, ReserveRequest
from backfill.policy import ClassLimits, PoolPolicy, ServiceClass
from bench.common import finish, parser, percentile, table

NAME = "ledger"
GOAL = 0.5
LATENCY_GOAL_MS = 1.0
BATCH = 100
NODE = "bench0"

RAW_RESERVE = """
local used = redis.call('HINCRBY', KEYS[1], 'used', ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return used
"""
"""The minimal reserve: bump the pool's counter, record the lease (``bench.fleet``'s raw floor
calls it too)."""
RAW_RELEASE = """
local tokens = redis.call('HGET', KEYS[2], ARGV[1])
if not tokens then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('HINCRBY', KEYS[1], 'used', -tonumber(tokens))
"""
"""The minimal release: drop the lease, lower the counter."""


def raw_pairs(client: redis.Redis, ns: str, pairs: int, pipelined: bool) -> float:
    keys = [f"{ns}:raw:pool", f"{ns}:raw:leases"]
    reserve = client.script_load(RAW_RESERVE)
    release = client.script_load(RAW_RELEASE)
    ids = [f"ls_{i:08x}" for i in range(pairs)]
    t0 = time.perf_counter()
    if pipelined:
        for start in range(0, pairs, BATCH):
            chunk = ids[start : start + BATCH]
            pipe = client.pipeline(transaction=False)
            for lease_id in chunk:
                pipe.evalsha(reserve, 2, *keys, lease_id, "208")
            pipe.execute()
            pipe = client.pipeline(transaction=False)
            for lease_id in chunk:
                pipe.evalsha(release, 2, *keys, lease_id)
            pipe.execute()
    else:
        for lease_id in ids:
            client.evalsha(reserve, 2, *keys, lease_id, "208")
            client.evalsha(release, 2, *keys, lease_id)
    return pairs / (time.perf_counter() - t0)


def ledger_pairs(
    ledger: Ledger, pairs: int, pipelined: bool, latencies: list[float] | None = None
) -> float:
    t0 = time.perf_counter()
    if pipelined:
        for _ in range(0, pairs, BATCH):
            results = ledger.reserve_many(
                [ReserveRequest(NODE, ServiceClass.BATCH, 100, 100) for _ in range(BATCH)]
            )
            leases = [r for r in results if isinstance(r, Lease)]
            assert len(leases) == BATCH, "the bench pool must admit every request"
            ledger.release_many(leases)
    else:
        for _ in range(pairs):
            s = time.perf_counter()
            lease = ledger.reserve(NODE, ServiceClass.BATCH, 100, 100)
            if latencies is not None:
                latencies.append((time.perf_counter() - s) * 1000)
            assert isinstance(lease, Lease)
            ledger.release(lease)
    return pairs / (time.perf_counter() - t0)


def best(runs: int, fn: Callable[[], float]) -> float:
    return max(fn() for _ in range(runs))


def main() -> None:
    args = parser(NAME, __doc__ or "").parse_args()
    pairs = 3_000 if args.quick else 20_000
    runs = 2 if args.quick else 3
    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url)
    ns = f"bfbench{secrets.token_hex(4)}"
    policy = PoolPolicy(
        interactive=ClassLimits(1 << 20),
        batch=ClassLimits(1 << 20),
        interactive_reserve_fraction=0.2,
    )
    ledger = Ledger(client, ns, policy, lease_ttl_ms=60_000)
    try:
        ledger.rebuild([NodePool(NODE, 1 << 40, 16)], [], epoch=1)
        ledger_pairs(ledger, 500, False)  # warm up: scripts loaded, connections open
        raw_pairs(client, ns, 500, False)
        latencies: list[float] = []
        # Alternate sides so neither always runs on the warmer server.
        raw_seq = best(runs, lambda: raw_pairs(client, ns, pairs, False))
        led_seq = best(runs, lambda: ledger_pairs(ledger, pairs, False, latencies))
        led_pipe = best(runs, lambda: ledger_pairs(ledger, pairs, True))
        raw_pipe = best(runs, lambda: raw_pairs(client, ns, pairs, True))
        snap = ledger.snapshot(NODE)
        assert snap is not None
        assert snap.reserved == 0
    finally:
        for key in client.scan_iter(match=f"{ns}:*", count=1000):
            client.delete(key)
        client.close()

    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    rows = [
        ("raw EVALSHA, minimal scripts", "sequential", raw_seq, ""),
        ("Backfill Ledger", "sequential", led_seq, f"{led_seq / raw_seq:.2f}"),
        ("raw EVALSHA, minimal scripts", f"pipelined x{BATCH}", raw_pipe, ""),
        ("Backfill Ledger", f"pipelined x{BATCH}", led_pipe, f"{led_pipe / raw_pipe:.2f}"),
    ]
    print(table(["path", "mode", "pairs/s (best)", "ratio"], rows))
    print()
    print(
        table(
            ["Ledger.reserve latency", "ms"],
            [("p50", p50), ("p99", p99), ("samples", len(latencies))],
        )
    )
    print(
        f"single admission p50 {p50:.3f} ms (goal <= {LATENCY_GOAL_MS} ms) "
        f"{'ok' if p50 <= LATENCY_GOAL_MS else 'short'}"
    )
    finish(
        NAME,
        "ratio_pipelined",
        led_pipe / raw_pipe,
        ">=",
        GOAL,
        {
            "pairs_per_run": pairs,
            "runs": runs,
            "raw_sequential_pairs_per_s": raw_seq,
            "ledger_sequential_pairs_per_s": led_seq,
            "ratio_sequential": led_seq / raw_seq,
            "raw_pipelined_pairs_per_s": raw_pipe,
            "ledger_pipelined_pairs_per_s": led_pipe,
            "reserve_p50_ms": p50,
            "reserve_p99_ms": p99,
            "reserve_p50_goal_ms": LATENCY_GOAL_MS,
        },
    )


if __name__ == "__main__":
    main()
