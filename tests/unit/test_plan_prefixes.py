"""Which reservations lean on a shared prompt prefix (``backfill.dispatch.prefix_starts``,
issue 36): only where the engine caches prefixes and the prefix is known cached, or the item is
its first holder here; the rest of its group waits (untouched in the queue) until the first
holder has prefilled it, and items that cannot share reserve their whole prompt, as without
prefixes."""

from __future__ import annotations

from backfill.dispatch import (
    FIRST_PREFILL_WAIT_S,
    CheckedItem,
    PrefixStarts,
    PrefixView,
    fit_starts,
    plan_prefix_starts,
    reserve_request,
)
from backfill.reservations import reservation_tokens
from tests.unit.dispatch_builders import BLOCK, budget, checked, flight, node

CACHING = PrefixView(caching=True)


def _ids(items: tuple[CheckedItem, ...]) -> list[int]:
    return [c.item.id for c in items]


def _plan(items: list[CheckedItem], view: PrefixView) -> tuple[list[int], list[int], list[int]]:
    """The ids starting, their shares, and the ids waiting."""
    plan: PrefixStarts = plan_prefix_starts(items, BLOCK, view)
    return _ids(plan.starting), list(plan.shares), _ids(plan.waiting)


def test_with_prefix_caching_off_every_item_reserves_its_whole_prompt() -> None:
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in (1, 2)]
    assert _plan(items, PrefixView(caching=False)) == ([1, 2], [0, 0], [])


def test_the_first_of_a_prefix_starts_alone_and_the_rest_wait_until_it_is_cached() -> None:
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in (1, 2, 3)]
    # Nothing of it in flight here: the first is its first holder, the rest wait for it
    # (started beside it, each would prefill and hold a copy of the prefix of its own).
    assert _plan(items, CACHING) == ([1], [64], [2, 3])
    # In flight here, not prefilled yet: all wait.
    busy = PrefixView(caching=True, busy=frozenset({"p"}), cold_for_s={"p": 0.5})
    assert _plan(items, busy) == ([], [], [1, 2, 3])
    # Prefilled by an attempt in flight: in the engine's cache, every item leans on it.
    warm = PrefixView(caching=True, warm=frozenset({"p"}), busy=frozenset({"p"}))
    assert _plan(items, warm) == ([1, 2, 3], [64, 64, 64], [])


def test_a_first_holder_that_does_not_prefill_in_time_no_longer_holds_its_group_back() -> None:
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in (1, 2)]
    stuck = PrefixView(caching=True, busy=frozenset({"p"}), cold_for_s={"p": FIRST_PREFILL_WAIT_S})
    # They may prefill beside it, each its own copy: whole prompts, as without prefixes.
    assert _plan(items, stuck) == ([1, 2], [0, 0], [])


def test_once_the_first_holder_is_gone_unprefilled_the_next_item_becomes_the_first() -> None:
    # Its attempt failed or was preempted before its first token: nothing of the prefix is
    # in flight here (the dispatcher's view leaves stopping attempts out).
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in (2, 3)]
    assert _plan(items, CACHING) == ([2], [64], [3])


def test_groups_wait_apart_and_items_that_cannot_share_never_wait() -> None:
    items = [
        checked(1, prefix_id="p", prefix_blocks=4),
        checked(2),
        checked(3, prefix_id="p", prefix_blocks=4, sequences=2),  # several sequences
        checked(4, prompt=64, prefix_id="p", prefix_blocks=4),  # no token past the prefix
        checked(5, prefix_id="q", prefix_blocks=4),
        checked(6, prefix_id="p", prefix_blocks=4),
        checked(7, prefix_id="r", prefix_blocks=4),
    ]
    view = PrefixView(caching=True, busy=frozenset({"r"}), cold_for_s={"r": 1.0})
    assert _plan(items, view) == ([1, 2, 3, 4, 5], [64, 0, 0, 0, 64], [6, 7])


def test_the_request_names_the_prefix_only_when_it_leans_on_it() -> None:
    item = checked(1, prefix_id="p", prefix_blocks=4)
    leaning = reserve_request(item, "n", max_preemptions=3, lease_ttl_s=30, prefix_tokens=64)
    assert (leaning.prefix_id, leaning.prefix_tokens) == ("p", 64)
    whole = reserve_request(item, "n", max_preemptions=3, lease_ttl_s=30)
    assert (whole.prefix_id, whole.prefix_tokens) == (None, 0)


def test_the_slack_takes_more_items_once_the_node_holds_their_prefix() -> None:
    whole = reservation_tokens(100, 64, BLOCK)  # 176
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in range(1, 6)]
    shares = [64] * 5
    view = node(flight(99))
    slack = 3 * whole
    # Without sharing, three fit.
    assert len(fit_starts(items, view, slack, BLOCK).fits) == 3
    # Held already: each asks its own 112 tokens; 4 fit in 528.
    held = fit_starts(items, view, slack, BLOCK, shares=shares, held_prefixes=frozenset({"p"}))
    assert len(held.fits) == 4
    # Not held yet: the first pays the prefix too, the rest their own.
    fresh = fit_starts(items, view, slack, BLOCK, shares=shares)
    assert len(fresh.fits) == 1 + (slack - whole) // (whole - 64)


def test_the_work_budget_is_charged_what_the_engine_prefills_not_the_cached_prefix() -> None:
    """Red before: a leaning item was charged its whole prompt against the prefill room, so a
    budget of 150 tokens started one 100-token item at a time, though the engine computes 36
    tokens of each (its 64-token prefix is in its cache)."""
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in range(1, 6)]
    warm = PrefixView(caching=True, warm=frozenset({"p"}), busy=frozenset({"p"}))
    plan = plan_prefix_starts(items, BLOCK, warm)
    assert plan.cached == (64,) * 5
    view = node(flight(99), budget=budget(max_seqs=8, max_prefill_tokens=150))
    fits = fit_starts(
        plan.starting,
        view,
        10_000,
        BLOCK,
        shares=plan.shares,
        held_prefixes=frozenset({"p"}),
        cached=plan.cached,
    ).fits
    assert len(fits) == 4  # 4 x 36 tokens computed fit in 150
    # A first holder prefills the prefix itself: charged its whole prompt.
    first = plan_prefix_starts(items, BLOCK, CACHING)
    assert (first.shares, first.cached) == ((64,), (0,))
