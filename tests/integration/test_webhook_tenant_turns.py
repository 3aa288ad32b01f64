"""A webhook sender's slots are shared between tenants, not only between endpoints: a tenant
with many endpoints gets a turn as a tenant with one does, and no tenant holds more than
``BACKFILL_WEBHOOKS_PER_TENANT`` attempts in flight (issue 35: "a bound on attempts in flight
per endpoint and per tenant and a fair share between tenants")."""

from __future__ import annotations

import pytest
from batch_api_support import make_tenant
from test_webhooks import complete
from webhook_receiver import new_receiver

from backfill.config import Settings
from backfill.store import Repository
from backfill.webhooks.endpoints import add_endpoint
from backfill.webhooks.store import WebhookStore


@pytest.fixture
def store(repo: Repository) -> WebhookStore:
    return WebhookStore(repo.engine)


def _tenants(
    repo: Repository, store: WebhookStore, settings: Settings, endpoints_of_a: int
) -> tuple[set[str], set[str]]:
    """Tenant A with ``endpoints_of_a`` endpoints and a batch ended (a delivery due to each),
    then tenant B with one endpoint and a batch ended after A's: the endpoint ids of each."""
    ids: dict[str, set[str]] = {}
    for name, endpoints in (("a", endpoints_of_a), ("b", 1)):
        tenant = make_tenant(repo, name)
        ids[name] = {
            add_endpoint(store, settings, tenant.id, url=new_receiver().url)[0].id
            for _ in range(endpoints)
        }
        complete(repo, settings, tenant)
    return ids["a"], ids["b"]


def test_a_tenant_with_many_endpoints_does_not_take_every_free_slot_before_another_tenant(
    repo: Repository, store: WebhookStore, hook_settings: Settings
) -> None:
    # A's four deliveries are older than B's one; endpoints taking turns alone gave the two
    # free slots to two of A's endpoints (each one's first delivery, oldest first).
    a, b = _tenants(repo, store, hook_settings, endpoints_of_a=4)
    claimed = store.claim_due(2, 5.0, per_endpoint=2)
    assert {c.endpoint_id for c in claimed} & b, "B waited behind every one of A's endpoints"
    assert len({c.endpoint_id for c in claimed} & a) == 1


def test_no_tenant_has_more_than_its_bound_in_flight_counting_what_is_already_held(
    repo: Repository, store: WebhookStore, hook_settings: Settings
) -> None:
    a, b = _tenants(repo, store, hook_settings, endpoints_of_a=4)
    first = store.claim_due(10, 5.0, per_endpoint=2, per_tenant=2)
    assert sum(c.endpoint_id in a for c in first) == 2
    assert sum(c.endpoint_id in b for c in first) == 1
    # A's two in flight fill its bound: the next claim takes none of A's.
    held = {c.endpoint_id: 1 for c in first}
    tenants_held = {first_a.tenant_id: 2 for first_a in first if first_a.endpoint_id in a}
    assert store.claim_due(10, 5.0, busy=held, busy_tenants=tenants_held, per_tenant=2) == []
    # Without a bound (the default is a quarter of the slots) A's other two go.
    again = store.claim_due(10, 5.0, busy=held, busy_tenants=tenants_held, per_tenant=4)
    assert len(again) == 2
    assert all(c.endpoint_id in a for c in again)
