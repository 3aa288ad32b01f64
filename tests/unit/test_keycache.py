"""The tenant key cache: found and unknown keys remembered within the TTL, evicted on
revocation, bounded in size."""

from __future__ import annotations

from backfill.keycache import TenantKeyCache
from backfill.store import TenantRecord, key_digest
from tests.unit.support_clock import HandClock

ACME = TenantRecord("tnt_1", "acme", None)


def test_a_found_tenant_is_remembered_until_the_ttl_passes() -> None:
    calls: list[str] = []
    clock = HandClock()

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


def test_a_wrong_key_costs_one_lookup_per_ttl_not_one_per_request() -> None:
    calls: list[str] = []
    clock = HandClock()

    def lookup(key: str) -> TenantRecord | None:
        calls.append(key)
        return None

    cache = TenantKeyCache(lookup, 5.0, clock=clock)
    assert cache.cached("bad") == (False, None)  # only Postgres can tell yet
    for _ in range(100):
        assert cache.get("bad") is None
    assert calls == ["bad"]
    assert cache.cached("bad") == (True, None)
    clock.now = 5.1
    assert cache.get("bad") is None
    assert calls == ["bad", "bad"]


def test_an_evicted_key_is_checked_again_at_once() -> None:
    answers: dict[str, TenantRecord | None] = {"k": ACME}
    cache = TenantKeyCache(answers.get, 5.0, clock=HandClock())
    assert cache.get("k") == ACME
    answers["k"] = None  # revoked in Postgres
    assert cache.get("k") == ACME  # still remembered
    cache.evict(key_digest("k"))
    assert cache.get("k") is None
    answers["j"] = ACME
    assert cache.get("j") == ACME
    cache.clear()
    answers["j"] = None
    assert cache.get("j") is None


def test_ttl_zero_disables_the_cache_and_size_is_bounded() -> None:
    calls: list[str] = []

    def lookup(key: str) -> TenantRecord | None:
        calls.append(key)
        return ACME

    assert TenantKeyCache(lookup, 0, clock=HandClock()).get("k") == ACME
    cache = TenantKeyCache(lookup, 5.0, max_entries=2, clock=HandClock())
    for key in ("a", "b", "c", "a"):
        cache.get(key)
    assert calls == ["k", "a", "b", "c", "a"]  # "a" was pushed out by "c"
    assert cache.cached("b") == (False, None)  # and "b" by the second "a"
