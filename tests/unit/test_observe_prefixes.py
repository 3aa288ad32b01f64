"""What batch holds in the engine with shared prefixes (``backfill.observe``, issue 36): a
prefix's blocks once, each lease's own past them; and the engine's use checked against the
ledger's reservations."""

from __future__ import annotations

from backfill.capacity import EnginePool
from backfill.ledger import Lease
from backfill.observe import allocated_over_reserved, batch_physical_tokens
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


def test_prefix_caching_is_read_from_the_engines_cache_config() -> None:
    on = EnginePool(4, 16, 64, labels={"enable_prefix_caching": "True"})
    off = EnginePool(4, 16, 64, labels={"enable_prefix_caching": "False"})
    assert on.prefix_caching
    assert not off.prefix_caching
    assert not EnginePool(4, 16, 64).prefix_caching
