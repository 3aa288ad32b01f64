"""What batch holds in the engine with shared prefixes (``backfill.observe``, issue 36): a
prefix's blocks once, each lease's own past them; and the engine's use checked against the
ledger's reservations."""

from __future__ import annotations

from backfill.engine_metrics import EnginePool
from backfill.ledger import Lease, PoolSnapshot
from backfill.ledger.values import PrefixHold
from backfill.observe import (
    allocated_over_reserved,
    batch_physical_tokens,
    engine_held_tokens,
    reserved_around,
)
from backfill.policy import ServiceClass

BLOCK = 16


def _lease(lease_id: str, tokens: int, prefix: str | None = None, ptok: int = 0) -> Lease:
    return Lease(
        lease_id, "n", ServiceClass.BATCH, tokens, 1, 0, 0, prefix_id=prefix, prefix_tokens=ptok
    )


def test_a_shared_prefix_is_held_once_and_each_lease_its_own_blocks_past_it() -> None:
    leases = [_lease("a", 48, "p", 64), _lease("b", 48, "p", 64), _lease("c", 112)]
    # a and b have prefilled 64 + 20 tokens (+ generated); c is another worker's.
    in_engine = {"a": 84, "b": 90}
    # a: 96 - 64 = 32; b: 96 - 64 = 32; c at its reservation; the prefix once.
    assert batch_physical_tokens(leases, in_engine, BLOCK) == 32 + 32 + 112 + 64


def test_a_lease_counts_no_more_than_its_own_reservation() -> None:
    leases = [_lease("a", 48, "p", 64)]
    assert batch_physical_tokens(leases, {"a": 10_000}, BLOCK) == 48 + 64


def test_allocated_above_reserved_is_what_breaks_the_invariant() -> None:
    assert allocated_over_reserved(1024, 1100) == 0
    assert allocated_over_reserved(1200, 1100) == 100


def test_the_engines_gauge_counts_its_blocks_but_the_null_one() -> None:
    # 48 blocks, one of them vLLM's null block: 29 used read as 29/47 of the pool.
    assert engine_held_tokens(29 / 47, 48 * 128, 128) == 29 * 128
    assert engine_held_tokens(0.0, 48 * 128, 128) == 0
    assert engine_held_tokens(1.0, 48 * 128, 128) == 47 * 128


def test_prefix_caching_is_read_from_the_engines_cache_config() -> None:
    on = EnginePool(4, 16, 64, labels={"enable_prefix_caching": "True"})
    off = EnginePool(4, 16, 64, labels={"enable_prefix_caching": "False"})
    assert on.prefix_caching
    assert not off.prefix_caching
    assert not EnginePool(4, 16, 64).prefix_caching


def _snap(leases: list[Lease], prefixes: list[PrefixHold]) -> PoolSnapshot:
    return PoolSnapshot(
        "n", 0, True, 6144, BLOCK, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0,
        tuple(leases), tuple(prefixes),
    )  # fmt: skip


def test_an_engine_reading_between_two_snapshots_is_held_to_what_either_reserved() -> None:
    ended = _lease("ended", 48, "p", 64)  # released after the reading
    begun = _lease("begun", 112)  # reserved before the reading, after the first snapshot
    kept = _lease("kept", 48, "p", 64)
    before = _snap([ended, kept], [PrefixHold("p", 64, 2)])
    after = _snap([kept, begun], [PrefixHold("p", 64, 1)])
    assert reserved_around(before, after) == 48 + 48 + 112 + 64
