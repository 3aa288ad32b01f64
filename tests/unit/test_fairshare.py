"""The fair-share decisions as pure functions: claim order and feasibility under sharing."""

from __future__ import annotations

from collections import Counter

import pytest

from backfill.fairshare import TenantBacklog, TenantUse, claim_order, tokens_until_done


def test_equal_weights_alternate_from_an_empty_node() -> None:
    order = claim_order([TenantUse("a", 1, 0), TenantUse("b", 1, 0)], 6)
    assert Counter(order) == {"a": 3, "b": 3}
    assert all(order[i] != order[i + 1] for i in range(5))


def test_a_tenant_below_its_share_catches_up_first() -> None:
    order = claim_order([TenantUse("a", 1, 6), TenantUse("b", 1, 0)], 8)
    assert order[:6] == ("b",) * 6
    assert Counter(order) == {"a": 1, "b": 7}


def test_weights_two_to_one() -> None:
    order = claim_order([TenantUse("heavy", 2, 0), TenantUse("light", 1, 0)], 9)
    assert Counter(order) == {"heavy": 6, "light": 3}
    # Every prefix stays within one slot of 2:1.
    for n in range(1, 10):
        heavy = order[:n].count("heavy")
        assert abs(heavy - 2 * n / 3) <= 1


def test_a_tenant_alone_gets_every_slot_and_no_tenant_gets_none() -> None:
    assert claim_order([TenantUse("a", 0.5, 100)], 4) == ("a",) * 4
    assert claim_order([], 4) == ()
    assert claim_order([TenantUse("a", 1, 0)], 0) == ()


def test_ties_are_broken_the_same_way_every_time() -> None:
    view = [TenantUse("b", 1, 0), TenantUse("a", 1, 0), TenantUse("c", 2, 1)]
    assert claim_order(view, 7) == claim_order(list(reversed(view)), 7)


def test_a_weight_of_zero_is_refused() -> None:
    with pytest.raises(ValueError, match="weight"):
        claim_order([TenantUse("a", 0, 0)], 1)


def test_many_tenants_share_in_proportion() -> None:
    view = [TenantUse(f"t{i}", 1 + i % 3, 0) for i in range(300)]
    counts = Counter(claim_order(view, 6000))
    for use in view:
        assert counts[use.tenant_id] == pytest.approx(6000 * use.weight / 600, abs=1)


def test_a_tenant_alone_is_judged_on_the_whole_throughput() -> None:
    assert tokens_until_done([], "a", 1, 1000) == 1000
    assert tokens_until_done([TenantBacklog("a", 1, 500)], "a", 1, 1000) == 1500


def test_beside_a_deep_backlog_a_small_batch_waits_for_its_half_only() -> None:
    backlog = [TenantBacklog("big", 1, 10_000_000)]
    assert tokens_until_done(backlog, "small", 1, 1000) == 2000
    # Weight 3 against 1: the small tenant gets three quarters of the throughput.
    assert tokens_until_done(backlog, "small", 3, 3000) == 4000


def test_a_tenant_that_runs_out_gives_its_share_to_the_rest() -> None:
    backlog = [TenantBacklog("tiny", 1, 100), TenantBacklog("big", 1, 10_000)]
    # "tiny" is done after 200 tokens of shared work; the rest is this tenant and "big" alone.
    assert tokens_until_done(backlog, "new", 1, 1000) == 100 + 1000 + 1000
    # Its own backlog counts in full.
    assert tokens_until_done(backlog, "big", 1, 10) == 10_010 + 100
