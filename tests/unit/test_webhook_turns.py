"""Which due webhook deliveries a sender takes (``choose_due``, pure): the candidates come in
turns across endpoints, healthy ones first; the choice keeps each endpoint under its cap of
attempts in flight and failing endpoints within their room."""

from __future__ import annotations

from backfill.webhooks.outbox import choose_due


def test_each_endpoint_keeps_under_its_cap_counting_what_is_in_flight() -> None:
    candidates = [(1, "a", False), (2, "b", False), (3, "a", False), (4, "b", False)]
    held = {"a": 1}
    assert choose_due(candidates, 10, 2, held, 10) == [1, 2, 4]
    assert held == {"a": 2, "b": 2}


def test_the_limit_stops_the_choice() -> None:
    candidates = [(1, "a", False), (2, "b", False), (3, "c", False)]
    assert choose_due(candidates, 2, 5, {}, 5) == [1, 2]


def test_failing_endpoints_get_at_most_their_room() -> None:
    candidates = [(1, "a", False), (2, "x", True), (3, "y", True), (4, "b", False)]
    assert choose_due(candidates, 10, 5, {}, 1) == [1, 2, 4]
    assert choose_due(candidates, 10, 5, {}, 0) == [1, 4]
