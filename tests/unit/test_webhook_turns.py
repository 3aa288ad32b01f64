"""Which due webhook deliveries a sender takes (``choose_due``, pure): the candidates come in
turns across tenants (and a tenant's endpoints), healthy ones first; the choice keeps each
endpoint and each tenant under its cap of attempts in flight and failing endpoints within
their room."""

from __future__ import annotations

from backfill.webhooks.outbox import SendRoom, choose_due


def room(
    limit: int = 10, per_endpoint: int = 5, per_tenant: int = 10, failing: int = 10
) -> SendRoom:
    return SendRoom(limit=limit, per_endpoint=per_endpoint, per_tenant=per_tenant, failing=failing)


def test_each_endpoint_keeps_under_its_cap_counting_what_is_in_flight() -> None:
    candidates = [
        (1, "a", "t", False),
        (2, "b", "u", False),
        (3, "a", "t", False),
        (4, "b", "u", False),
    ]
    held = {"a": 1}
    assert choose_due(candidates, room(per_endpoint=2), held, {}) == [1, 2, 4]
    assert held == {"a": 2, "b": 2}


def test_each_tenant_keeps_under_its_cap_over_all_its_endpoints() -> None:
    candidates = [
        (1, "a", "t", False),
        (2, "b", "t", False),
        (3, "c", "u", False),
        (4, "d", "t", False),
    ]
    tenants = {"t": 1}
    assert choose_due(candidates, room(per_tenant=2), {}, tenants) == [1, 3]
    assert tenants == {"t": 2, "u": 1}


def test_the_limit_stops_the_choice() -> None:
    candidates = [(1, "a", "t", False), (2, "b", "u", False), (3, "c", "v", False)]
    assert choose_due(candidates, room(limit=2), {}, {}) == [1, 2]


def test_failing_endpoints_get_at_most_their_room() -> None:
    candidates = [
        (1, "a", "t", False),
        (2, "x", "u", True),
        (3, "y", "v", True),
        (4, "b", "w", False),
    ]
    assert choose_due(candidates, room(failing=1), {}, {}) == [1, 2, 4]
    assert choose_due(candidates, room(failing=0), {}, {}) == [1, 4]
