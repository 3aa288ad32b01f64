"""Which reservations lean on a shared prompt prefix (``backfill.dispatch.starts``, issue 36):
only where the engine caches prefixes and the prefix is known cached, or the item is its
first holder here; the rest reserve their whole prompt, as without prefixes."""

from __future__ import annotations

from backfill.dispatch import PrefixView, fit_starts, reserve_request, shared_prefix_tokens
from backfill.reservations import reservation_tokens
from tests.unit.dispatch_builders import BLOCK, checked, flight, node

CACHING = PrefixView(caching=True)


def test_with_prefix_caching_off_every_item_reserves_its_whole_prompt() -> None:
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in (1, 2)]
    assert shared_prefix_tokens(items, BLOCK, PrefixView(caching=False)) == [0, 0]


def test_the_first_of_a_prefix_leans_on_it_and_the_rest_wait_until_it_is_cached() -> None:
    items = [checked(i, prefix_id="p", prefix_blocks=4) for i in (1, 2, 3)]
    assert shared_prefix_tokens(items, BLOCK, CACHING) == [64, 0, 0]
    # In flight here, not prefilled yet: nobody leans on it.
    busy = PrefixView(caching=True, busy=frozenset({"p"}))
    assert shared_prefix_tokens(items, BLOCK, busy) == [0, 0, 0]
    # Prefilled by an attempt in flight: in the engine's cache, every item leans on it.
    warm = PrefixView(caching=True, warm=frozenset({"p"}), busy=frozenset({"p"}))
    assert shared_prefix_tokens(items, BLOCK, warm) == [64, 64, 64]


def test_items_without_a_prefix_or_of_several_sequences_reserve_as_before() -> None:
    items = [
        checked(1),
        checked(2, prefix_id="p", prefix_blocks=4, sequences=2),
        checked(3, prompt=64, prefix_id="q", prefix_blocks=4),  # no token past the prefix
        checked(4, prefix_id="r", prefix_blocks=4),
    ]
    assert shared_prefix_tokens(items, BLOCK, CACHING) == [0, 0, 0, 64]


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
