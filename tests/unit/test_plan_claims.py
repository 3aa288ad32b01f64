"""How many attempts a node starts and how many items it claims (``backfill.dispatch.claims``):
the node's cap, the work budget and a suspect engine bound the starts; the slack and the
budget's prefill room, judged by recent reservations and prompts, bound the claim."""

from __future__ import annotations

from dataclasses import replace

from backfill.dispatch import (
    BatchLoad,
    claim_size,
    claims_due,
    running_mean,
    start_room,
    startable,
)
from tests.unit.dispatch_builders import BLOCK, budget, flight, node, prefilling_flight


def test_room_is_the_cap_less_every_attempt_held_stopping_ones_included() -> None:
    view = node(flight(1), flight(2, stopping=True))
    assert start_room(view.load, None, 4) == 2


def test_the_work_budget_bounds_only_the_active_attempts() -> None:
    view = node(flight(1), flight(2, stopping=True))
    assert start_room(view.load, budget(max_seqs=3), 10) == 2


def test_a_held_budget_starts_nothing() -> None:
    assert start_room(node().load, budget(hold=True), 10) == 0


def test_a_suspect_engine_gets_one_attempt_at_a_time() -> None:
    assert start_room(node().load, None, 10, engine_suspect=True) == 1
    assert start_room(node(flight(1)).load, None, 10, engine_suspect=True) == 0


def test_room_is_never_negative() -> None:
    assert start_room(node(flight(1), flight(2)).load, budget(max_seqs=1), 1) == 0


def test_startable_counts_the_prompts_the_prefill_budget_takes_in_order() -> None:
    load = BatchLoad(in_flight=1, active=1, prefilling=600)
    assert startable(load, budget(max_prefill_tokens=1024), [300, 300, 10]) == 1
    assert startable(load, None, [300, 300, 10]) == 3


def test_claims_up_to_the_room_and_the_claim_batch() -> None:
    assert claim_size(node(), room=5, claim_batch=64, slack=10_000, block_size=BLOCK) == 5
    assert claim_size(node(), room=500, claim_batch=64, slack=10_000, block_size=BLOCK) == 64


def test_claims_nothing_with_less_slack_than_one_block() -> None:
    assert claim_size(node(), room=5, claim_batch=64, slack=BLOCK - 1, block_size=BLOCK) == 0


def test_claims_what_the_slack_fits_by_the_typical_reservation() -> None:
    view = node(typical_reservation=1000)
    assert claim_size(view, room=64, claim_batch=64, slack=3500, block_size=BLOCK) == 3


def test_an_idle_node_claims_one_item_even_when_it_looks_too_big() -> None:
    # The slack may have grown since; the ledger's denial says why if not.
    view = node(typical_reservation=1000)
    assert claim_size(view, room=64, claim_batch=64, slack=500, block_size=BLOCK) == 1


def test_a_busy_node_claims_nothing_its_slack_cannot_take() -> None:
    view = node(flight(1), typical_reservation=1000)
    assert claim_size(view, room=64, claim_batch=64, slack=500, block_size=BLOCK) == 0


def test_a_node_releasing_its_last_leases_claims_nothing_its_slack_cannot_take() -> None:
    # No attempt in flight, but leases not yet released: they free slack when they land.
    view = node(typical_reservation=1000, leases_held=1)
    assert claim_size(view, room=64, claim_batch=64, slack=500, block_size=BLOCK) == 0


def test_claims_no_more_than_the_prefill_budget_could_start() -> None:
    view = node(
        prefilling_flight(1, 500), budget=budget(max_prefill_tokens=1024), typical_prompt=200
    )
    assert claim_size(view, room=64, claim_batch=64, slack=10**6, block_size=BLOCK) == 2
    full = replace(view, flights=(prefilling_flight(1, 1024),))
    assert claim_size(full, room=64, claim_batch=64, slack=10**6, block_size=BLOCK) == 0


def test_without_a_prompt_seen_the_budget_does_not_shape_the_claim() -> None:
    view = node(prefilling_flight(1, 1024), budget=budget(max_prefill_tokens=1024))
    assert claim_size(view, room=4, claim_batch=64, slack=10**6, block_size=BLOCK) == 4


def test_the_typical_figure_starts_at_the_first_value_then_moves_a_quarter() -> None:
    assert running_mean(0, 400) == 400
    assert running_mean(400, 800) == 500


def test_a_claim_is_extended_every_other_beat_at_the_defaults_on_time_or_late() -> None:
    # Defaults: 30 s TTL, a beat every 5 s. Extended at 0: due once 7.5 s have passed.
    assert claims_due({1: 0.0}, 7.4, 5.0, 30.0) == []
    assert claims_due({1: 0.0}, 7.5, 5.0, 30.0) == []
    assert claims_due({1: 0.0}, 7.6, 5.0, 30.0) == [1]
    for beat_s in (5.0, 5.05, 5.5):
        extended_at, writes, least_left = 0.0, 0, 30.0
        for beat in range(1, 61):
            now = beat_s * beat
            least_left = min(least_left, extended_at + 30.0 - now)
            if claims_due({1: extended_at}, now, 5.0, 30.0):
                extended_at, writes = now, writes + 1
        assert writes == 30, beat_s
        assert least_left > 15.0, beat_s


def test_every_claim_is_extended_every_beat_when_the_beat_is_a_third_of_the_ttl() -> None:
    # The reliability suite's 3 s TTL and 1 s beat: every claim at every beat, as before.
    assert claims_due({1: 0.0, 2: 0.9}, 1.0, 1.0, 3.0) == [1, 2]
    assert claims_due({7: 0.0, 3: 0.0}, 10.0, 10.0, 30.0) == [3, 7]
    assert claims_due({}, 1.0, 1.0, 3.0) == []


def test_claims_extended_at_different_times_come_due_apart() -> None:
    at = {1: 0.0, 2: 5.0, 3: 10.0}
    assert claims_due(at, 10.0, 5.0, 30.0) == [1]
    assert claims_due(at, 15.0, 5.0, 30.0) == [1, 2]
