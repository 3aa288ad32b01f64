"""The tenant key cache: hits within the TTL, misses never cached, bounded size."""

from __future__ import annotations

from backfill.keycache import TenantKeyCache
from backfill.repository import TenantRecord

ACME = TenantRecord("tnt_1", "acme", None)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_found_tenant_is_remembered_until_the_ttl_passes() -> None:
    calls: list[str] = []
    clock = Clock()

    def lookup(key: str) -> TenantRecord | None:
        calls.append(key)
        return ACME

    cache = TenantKeyCache(lookup, 5.0, clock=clock)
    assert cache.get("k") == ACME
    clock.now = 4.9
    assert cache.get("k") == ACME
    assert len(calls) == 1
    clock.now = 5.1
    assert cache.get("k") == ACME
    assert len(calls) == 2


def test_unknown_keys_are_always_checked() -> None:
    calls: list[str] = []

    def lookup(key: str) -> TenantRecord | None:
        calls.append(key)
        return None

    cache = TenantKeyCache(lookup, 5.0, clock=Clock())
    assert cache.get("bad") is None
    assert cache.get("bad") is None
    assert len(calls) == 2


def test_ttl_zero_disables_the_cache_and_size_is_bounded() -> None:
    calls: list[str] = []

    def lookup(key: str) -> TenantRecord | None:
        calls.append(key)
        return ACME

    assert TenantKeyCache(lookup, 0, clock=Clock()).get("k") == ACME
    cache = TenantKeyCache(lookup, 5.0, max_entries=2, clock=Clock())
    for key in ("a", "b", "c", "a"):
        cache.get(key)
    assert calls == ["k", "a", "b", "c", "a"]  # "a" was pushed out by "c"
