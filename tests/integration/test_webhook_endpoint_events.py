"""An endpoint disabled for failing too long is an event its tenant hears (issue 35):
``webhook_endpoint.disabled``, written in the transaction that disabled it, delivered to the
tenant's other endpoints that named the type, signed like any event; in no endpoint's default
types; purged by age with the retention period. Real Postgres, real HTTP receivers, the real
sender.

Red before: a disabled endpoint was seen only by reading it (no event type, no event).
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from batch_api_support import make_tenant, serve
from openai import OpenAI
from sqlalchemy import text
from webhook_receiver import listening, new_receiver

from backfill.config import Settings
from backfill.store import Repository
from backfill.webhooks.delivery import Sender
from backfill.webhooks.endpoints import add_endpoint
from backfill.webhooks.events import DEFAULT_EVENT_TYPES, EventType
from backfill.webhooks.store import WebhookStore
from tests.integration.test_webhooks import complete

DISABLED = EventType.WEBHOOK_ENDPOINT_DISABLED.value
HANG_S = 60


@pytest.fixture
def store(repo: Repository) -> WebhookStore:
    return WebhookStore(repo.engine)


def _events_of_type(repo: Repository, event_type: str) -> list[tuple[str, str | None]]:
    with repo.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT subject_id, job_id FROM webhook_events WHERE type = :t"),
            {"t": event_type},
        ).all()
    return [(r[0], r[1]) for r in rows]


def test_a_disabled_endpoint_is_an_event_to_the_tenants_endpoints_that_named_it(
    repo: Repository, store: WebhookStore, hook_settings: Settings
) -> None:
    settings = hook_settings.model_copy(update={"webhooks_disable_after_s": 1.0})
    failing, watching, plain, elsewhere = (new_receiver() for _ in range(4))
    failing.default_status = 500
    tenant, other = make_tenant(repo, "acme"), make_tenant(repo, "other")
    down, _ = add_endpoint(store, settings, tenant.id, url=failing.url)
    watcher, secret = add_endpoint(
        store, settings, tenant.id, url=watching.url, event_types=[DISABLED]
    )
    add_endpoint(store, settings, tenant.id, url=plain.url)
    add_endpoint(store, settings, other.id, url=elsewhere.url, event_types=[DISABLED])
    batch_id = complete(repo, settings, tenant)
    sender = Sender(store, settings)
    try:
        with listening(failing), listening(watching), listening(plain), listening(elsewhere):
            deadline = time.monotonic() + HANG_S
            while not watching.received or not plain.received:
                assert time.monotonic() < deadline, "the disabled event never came"
                sender.run_round()
                time.sleep(0.1)
            # More failed attempts (none is claimed now) make no second event.
            sender.run_round()
    finally:
        sender.close()
    assert store.endpoint(tenant.id, down.id).disabled_at is not None
    [got] = watching.received
    event = json.loads(got.body)
    assert event["type"] == DISABLED
    assert event["data"] == {"id": down.id}
    # Signed as every event is: the SDK's own check passes with the watcher's secret.
    OpenAI(api_key="unused").webhooks.verify_signature(got.body, got.headers, secret=secret)
    # The endpoint with the default types heard the batch's end only; no other tenant heard.
    assert [json.loads(r.body)["type"] for r in plain.received] == ["batch.completed"]
    assert json.loads(plain.received[0].body)["data"] == {"id": batch_id}
    assert elsewhere.received == []
    assert _events_of_type(repo, DISABLED) == [(down.id, None)]
    # The delivery log names what the event is about.
    log = [d for d in store.deliveries(tenant.id) if d.endpoint_id == watcher.id]
    assert [(d.event_type, d.batch_id, d.subject_id) for d in log] == [(DISABLED, None, down.id)]


def test_the_disabled_event_is_in_no_default_subscription_and_is_listed(
    repo: Repository, hook_settings: Settings
) -> None:
    tenant = make_tenant(repo, "acme")
    with serve(hook_settings) as server:
        client = server.client(tenant.key)
        # The SDK always names the types; the API (and the CLI) takes none too.
        plain: Any = client.post(
            "/webhook_endpoints", body={"url": "http://127.0.0.1:9/plain"}, cast_to=object
        )
        named = client.webhooks.create(
            url="http://127.0.0.1:9/named", name="ops", event_types=[DISABLED]
        )
        listed = client.webhooks.event_types.list().data
    assert plain["event_types"] == list(DEFAULT_EVENT_TYPES)
    assert DISABLED not in DEFAULT_EVENT_TYPES
    assert named.event_types == [DISABLED]
    assert listed == [*DEFAULT_EVENT_TYPES, DISABLED]


def test_an_event_of_no_batch_is_purged_with_its_deliveries_by_age(
    repo: Repository, store: WebhookStore, hook_settings: Settings
) -> None:
    tenant = make_tenant(repo, "acme")
    watcher, _ = add_endpoint(
        store, hook_settings, tenant.id, url="http://127.0.0.1:9/", event_types=[DISABLED]
    )
    down, _ = add_endpoint(store, hook_settings, tenant.id, url="http://127.0.0.1:9/")
    with repo.engine.begin() as conn:
        for event_id, age in (("evt_old", "40 days"), ("evt_new", "1 day")):
            conn.execute(
                text(
                    "INSERT INTO webhook_events (id, tenant_id, subject_id, type, created_at) "
                    "VALUES (:e, :t, :s, :ty, now() - CAST(:age AS interval))"
                ),
                {"e": event_id, "t": tenant.id, "s": down.id, "ty": DISABLED, "age": age},
            )
            conn.execute(
                text(
                    "INSERT INTO webhook_deliveries (event_id, endpoint_id, tenant_id, "
                    "webhook_id) VALUES (:e, :w, :t, :e)"
                ),
                {"e": event_id, "w": watcher.id, "t": tenant.id},
            )
    report = repo.retention.purge_ended_jobs(30 * 86_400.0)
    with repo.engine.connect() as conn:
        events = list(conn.execute(text("SELECT id FROM webhook_events")).scalars())
        deliveries = list(conn.execute(text("SELECT event_id FROM webhook_deliveries")).scalars())
    assert events == ["evt_new"]
    assert deliveries == ["evt_new"]
    assert report.rows == 1
