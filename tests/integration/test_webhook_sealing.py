"""Webhook signing secrets sealed at rest: Postgres holds no secret that signs, deliveries are
signed with the clear secret all the same (the openai SDK verifies them), secrets stored in
clear are sealed once keys are set, and a key rotation reseals every endpoint."""

from __future__ import annotations

import pytest
from batch_api_support import LiveServer, make_tenant, serve
from openai import OpenAI
from pydantic import SecretStr
from sqlalchemy import text
from test_webhooks import (
    complete,
    delivered,
    hooked_job,
    rounds_until,
)
from webhook_receiver import Receiver, listening, new_receiver

from backfill.config import Settings
from backfill.store import Repository
from backfill.webhooks.delivery import Sender
from backfill.webhooks.endpoints import add_endpoint
from backfill.webhooks.sealing import SEALED, SecretSeal, UnsealError, new_key
from backfill.webhooks.store import WebhookStore

KEY_A, KEY_B = new_key(), new_key()
STORED = "SELECT secret, previous_secret FROM webhook_endpoints WHERE id = :i"


@pytest.fixture
def sealed_settings(hook_settings: Settings) -> Settings:
    """test_webhooks' settings, with key A sealing."""
    return hook_settings.model_copy(update={"webhooks_secret_keys": SecretStr(KEY_A)})


@pytest.fixture
def receiver() -> Receiver:
    return new_receiver()


def stored(repo: Repository, endpoint_id: str) -> tuple[str, str | None]:
    with repo.engine.connect() as conn:
        secret, previous = conn.execute(text(STORED), {"i": endpoint_id}).one()
    return secret, previous


def deliver(store: WebhookStore, settings: Settings) -> None:
    sender = Sender(store, settings)
    try:
        rounds_until(sender, delivered)
    finally:
        sender.close()


def test_a_secret_is_stored_sealed_and_deliveries_are_signed_with_it_in_clear(
    repo: Repository, sealed_settings: Settings, receiver: Receiver
) -> None:
    store = WebhookStore(repo.engine, SecretSeal(sealed_settings.webhooks_seal_keys))
    job = hooked_job(repo, store, sealed_settings, receiver)
    endpoint, old = job.endpoint, job.secret
    _, new = store.rotate_secret(job.tenant.id, endpoint.id, keep_old_for_s=3600)
    for value in stored(repo, endpoint.id):
        assert value is not None
        assert value.startswith(SEALED)
        assert old.removeprefix("whsec_") not in value
        assert new.removeprefix("whsec_") not in value
    assert store.endpoint(job.tenant.id, endpoint.id).signing_secret_hint.endswith(new[-4:])
    with listening(receiver):
        deliver(store, sealed_settings)
    [got] = receiver.received
    for secret in (old, new):
        OpenAI(api_key="unused").webhooks.verify_signature(got.body, got.headers, secret=secret)


def test_the_api_seals_what_the_sdk_creates(
    repo: Repository, sealed_settings: Settings, receiver: Receiver
) -> None:
    live: LiveServer
    with serve(sealed_settings) as live:
        tenant = make_tenant(repo, "acme")
        endpoint = live.client(tenant.key).webhooks.create(
            url=receiver.url, name="ops", event_types=["batch.completed"]
        )
        secret = endpoint.signing_secret
        assert secret is not None
        value, _ = stored(repo, endpoint.id)
        assert value.startswith(SEALED)
        assert secret.removeprefix("whsec_") not in value
        complete(repo, sealed_settings, tenant)
        store = WebhookStore(repo.engine, SecretSeal(sealed_settings.webhooks_seal_keys))
        with listening(receiver):
            deliver(store, sealed_settings)
    [got] = receiver.received
    OpenAI(api_key="unused").webhooks.verify_signature(got.body, got.headers, secret=secret)


def test_clear_secrets_are_sealed_once_keys_are_set_and_resealed_when_the_key_rotates(
    repo: Repository, sealed_settings: Settings, receiver: Receiver
) -> None:
    # Stored before any key was set: in clear.
    clear = WebhookStore(repo.engine)
    tenant = make_tenant(repo, "acme")
    endpoint, old = add_endpoint(clear, sealed_settings, tenant.id, url=receiver.url)
    _, new = clear.rotate_secret(tenant.id, endpoint.id, keep_old_for_s=3600)
    assert stored(repo, endpoint.id) == (new, old)
    # Key A set: a sender's housekeeping seals both.
    sealed_a = WebhookStore(repo.engine, SecretSeal([KEY_A]))
    complete(repo, sealed_settings, tenant)
    with listening(receiver):
        deliver(sealed_a, sealed_settings)
    secret, previous = stored(repo, endpoint.id)
    assert secret.startswith(SEALED)
    assert previous is not None
    assert previous.startswith(SEALED)
    assert SecretSeal([KEY_A]).open(secret) == new
    # Rotation: B first, A still opening; the sender reseals under B, and A can go.
    rotated = sealed_settings.model_copy(
        update={"webhooks_secret_keys": SecretStr(f"{KEY_B},{KEY_A}")}
    )
    sealed_b = WebhookStore(repo.engine, SecretSeal(rotated.webhooks_seal_keys))
    complete(repo, sealed_settings, tenant)
    with listening(receiver):
        deliver(sealed_b, rotated)
    secret, previous = stored(repo, endpoint.id)
    assert previous is not None
    only_b = SecretSeal([KEY_B])
    assert (only_b.open(secret), only_b.open(previous)) == (new, old)
    with pytest.raises(UnsealError):
        SecretSeal([KEY_A]).open(secret)
    # Every delivery verified with the clear secrets.
    for got in receiver.received:
        OpenAI(api_key="unused").webhooks.verify_signature(got.body, got.headers, secret=new)


def test_a_sealed_secret_without_its_key_is_a_clear_error_not_a_bad_signature() -> None:
    sealed = SecretSeal([KEY_A]).seal("whsec_abc")
    with pytest.raises(UnsealError, match="BACKFILL_WEBHOOKS_SECRET_KEYS is not set"):
        SecretSeal().open(sealed)
    with pytest.raises(UnsealError, match="no longer holds"):
        SecretSeal([KEY_B]).open(sealed)
