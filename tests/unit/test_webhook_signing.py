"""Webhook events, signatures, targets and the retry plan: pure, checked against the openai
SDK's own types and verifier."""

from __future__ import annotations

import base64
import json
import time

import pytest
from openai import OpenAI
from openai._exceptions import InvalidWebhookSignatureError
from openai.types.webhooks import (
    BatchCancelledWebhookEvent,
    BatchCompletedWebhookEvent,
    BatchExpiredWebhookEvent,
    BatchFailedWebhookEvent,
)

from backfill.config import Settings
from backfill.states import JOB_TERMINAL, JobState
from backfill.webhooks.delivery import prepare
from backfill.webhooks.events import (
    ALL_EVENT_TYPES,
    DEFAULT_EVENT_TYPES,
    EVENT_OF_STATE,
    EventType,
    event_body,
    new_event_id,
    parse_event_types,
)
from backfill.webhooks.outbox import ClaimedDelivery
from backfill.webhooks.retry import (
    AttemptResult,
    DeliveryState,
    RetryPolicy,
    after_attempt,
)
from backfill.webhooks.signing import new_secret, signed_headers
from backfill.webhooks.targets import TargetRefused, address_refusal, check_target, parse_url

DISABLED = EventType.WEBHOOK_ENDPOINT_DISABLED.value
SDK_TYPES = {
    "batch.completed": BatchCompletedWebhookEvent,
    "batch.failed": BatchFailedWebhookEvent,
    "batch.expired": BatchExpiredWebhookEvent,
    "batch.cancelled": BatchCancelledWebhookEvent,
}


def sdk() -> OpenAI:
    return OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")


def test_every_terminal_job_state_sends_its_event_and_no_other_state_does() -> None:
    assert set(EVENT_OF_STATE) == JOB_TERMINAL
    assert {e.value for e in EVENT_OF_STATE.values()} == set(DEFAULT_EVENT_TYPES)
    assert JobState.IN_PROGRESS not in EVENT_OF_STATE


@pytest.mark.parametrize("event_type", DEFAULT_EVENT_TYPES)
def test_a_signed_event_unwraps_with_the_sdk_as_its_own_type(event_type: str) -> None:
    secret = new_secret()
    event_id = new_event_id()
    body = event_body(event_id, event_type, 1_764_000_000, "batch_abc")
    headers = signed_headers([secret], "wh_1", int(time.time()), body)
    event = sdk().webhooks.unwrap(body, headers, secret=secret)
    assert isinstance(event, SDK_TYPES[event_type])
    assert event.id == event_id
    assert event.type == event_type
    assert event.object == "event"
    assert event.created_at == 1_764_000_000
    assert event.data.id == "batch_abc"


def test_the_secret_is_whsec_and_32_base64_bytes() -> None:
    secret = new_secret()
    assert secret.startswith("whsec_")
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    assert new_secret() != secret


def test_another_secret_a_changed_body_or_an_old_timestamp_fail_the_sdk_check() -> None:
    secret = new_secret()
    body = event_body("evt_1", "batch.completed", 1, "batch_1")
    now = int(time.time())
    headers = signed_headers([secret], "wh_1", now, body)
    hooks = sdk().webhooks
    with pytest.raises(InvalidWebhookSignatureError):
        hooks.unwrap(body, headers, secret=new_secret())
    with pytest.raises(InvalidWebhookSignatureError):
        hooks.unwrap(body.replace(b"batch_1", b"batch_2"), headers, secret=secret)
    stale = signed_headers([secret], "wh_1", now - 600, body)
    with pytest.raises(InvalidWebhookSignatureError):
        hooks.unwrap(body, stale, secret=secret)


def test_while_a_rotated_secret_is_kept_either_secret_verifies() -> None:
    old, new = new_secret(), new_secret()
    body = event_body("evt_1", "batch.failed", 1, "batch_1")
    headers = signed_headers([new, old], "wh_1", int(time.time()), body)
    assert len(headers["webhook-signature"].split()) == 2
    for secret in (old, new):
        sdk().webhooks.verify_signature(body, headers, secret=secret)


def test_the_body_is_the_same_bytes_every_time() -> None:
    a = event_body("evt_1", "batch.completed", 5, "batch_1")
    assert a == event_body("evt_1", "batch.completed", 5, "batch_1")
    assert json.loads(a) == {
        "id": "evt_1",
        "object": "event",
        "type": "batch.completed",
        "created_at": 5,
        "data": {"id": "batch_1"},
    }


def test_a_disabled_endpoints_event_unwraps_with_the_sdk_by_its_type() -> None:
    """Backfill's own event: the SDK has no class for it, but verifies it and keeps its
    ``type`` and ``data.id`` (what docs/webhooks.md tells a receiver to go by)."""
    secret = new_secret()
    body = event_body(new_event_id(), DISABLED, 1_764_000_000, "we_abc")
    headers = signed_headers([secret], "wh_1", int(time.time()), body)
    event = sdk().webhooks.unwrap(body, headers, secret=secret)
    assert event.type == DISABLED
    assert event.data.id == "we_abc"


def test_event_types_default_to_the_batch_events_and_unknown_ones_are_refused() -> None:
    assert parse_event_types(None) == list(DEFAULT_EVENT_TYPES)
    assert DISABLED in ALL_EVENT_TYPES
    assert DISABLED not in DEFAULT_EVENT_TYPES
    assert parse_event_types([DISABLED, "batch.failed"]) == ["batch.failed", DISABLED]
    assert parse_event_types(["batch.failed", "batch.completed", "batch.failed"]) == [
        "batch.completed",
        "batch.failed",
    ]
    with pytest.raises(ValueError, match=r"response\.completed"):
        parse_event_types(["response.completed"])


# -- targets ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00:ec2::254",
        "::ffff:127.0.0.1",
        "::",
        # Special-purpose blocks Python's is_global lets through.
        "192.0.0.8",
        "192.0.0.9",
        "fec0::1",
        "3fff::1",
        "64:ff9b::a00:1",
        "192.88.99.1",
        "5f00::1",
    ],
)
def test_inside_addresses_are_refused_by_default(address: str) -> None:
    assert address_refusal(address, allow_private=False) is not None
    assert address_refusal(address, allow_private=True) is None


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:4700::6810:84e5"])
def test_public_addresses_are_allowed(address: str) -> None:
    assert address_refusal(address, allow_private=False) is None


def test_the_default_settings_refuse_loopback_and_private_targets() -> None:
    assert Settings().webhooks_allow_private is False
    for url in ("http://127.0.0.1:8080/hook", "http://10.0.0.5/hook", "http://[::1]/x"):
        with pytest.raises(TargetRefused):
            check_target(url, allow_private=False)


def test_a_name_is_refused_if_any_of_its_addresses_is_inside() -> None:
    def resolve(host: str, port: int) -> list[str]:
        return ["93.184.215.14", "10.0.0.7"]

    with pytest.raises(TargetRefused, match=r"hooks\.example\.com resolves to 10\.0\.0\.7"):
        check_target("https://hooks.example.com/x", allow_private=False, resolve=resolve)


def test_a_send_connects_to_the_checked_address_with_the_name_as_host() -> None:
    calls: list[tuple[str, int]] = []

    def resolve(host: str, port: int) -> list[str]:
        calls.append((host, port))
        return ["93.184.215.14"]

    target = check_target(
        "https://Hooks.Example.com:8443/in?x=1", allow_private=False, resolve=resolve
    )
    assert calls == [("hooks.example.com", 8443)]
    assert target.connect_url == "https://93.184.215.14:8443/in?x=1"
    assert target.host_header == "hooks.example.com:8443"
    ipv6 = check_target(
        "http://hooks.example.com/", allow_private=False, resolve=lambda h, p: ["2606:4700::1"]
    )
    assert ipv6.connect_url == "http://[2606:4700::1]:80/"
    assert ipv6.host_header == "hooks.example.com"


@pytest.mark.parametrize(
    "url",
    [
        "ftp://example.com/x",
        "file:///etc/passwd",
        "example.com/hook",
        "http:///nohost",
        "http://user:pw@example.com/",
        "http://example.com:99999/",
        "http://" + "a" * 3000 + ".com/",
    ],
)
def test_urls_that_are_not_plain_http_targets_are_refused(url: str) -> None:
    with pytest.raises(TargetRefused):
        parse_url(url)


# -- the retry plan ---------------------------------------------------------------------------


def test_backoff_doubles_from_the_base_up_to_the_cap_with_jitter_in_its_upper_half() -> None:
    policy = RetryPolicy(base_s=5, max_delay_s=3600, retry_for_s=86400)
    assert [policy.delay_s(n, 1.0) for n in (1, 2, 3, 4)] == [5, 10, 20, 40]
    assert policy.delay_s(30, 1.0) == 3600
    assert policy.delay_s(3, 0.0) == 10
    assert 10 <= policy.delay_s(3, 0.5) <= 20


def test_the_default_schedule_retries_for_a_day_then_stops() -> None:
    schedule = RetryPolicy().schedule()
    assert schedule[:4] == [0, 5, 15, 35]
    assert schedule[-1] <= 86400 < schedule[-1] + 3600
    assert 25 < len(schedule) < 40


def test_a_2xx_delivers_anything_else_retries_until_the_period_is_spent() -> None:
    policy = RetryPolicy(base_s=5, max_delay_s=3600, retry_for_s=86400)
    ok = after_attempt(AttemptResult(204), attempts=3, age_s=100, policy=policy, jitter=0.5)
    assert ok.state is DeliveryState.DELIVERED
    for result in (AttemptResult(500), AttemptResult(301), AttemptResult(error="refused")):
        again = after_attempt(result, attempts=2, age_s=100, policy=policy, jitter=1.0)
        assert again.state is DeliveryState.PENDING
        assert again.retry_in_s == 10
    last = after_attempt(AttemptResult(503), attempts=30, age_s=84000, policy=policy, jitter=1.0)
    assert last.state is DeliveryState.FAILED


def test_an_attempt_carries_the_stored_ids_and_a_fresh_timestamp() -> None:
    secret = new_secret()
    claimed = ClaimedDelivery(
        delivery_id=1,
        attempt=2,
        webhook_id="wh_stable",
        event_id="evt_1",
        event_type="batch.expired",
        subject_id="batch_9",
        event_created_at=1000,
        age_s=10.0,
        url="https://hooks.example.com/x",
        secrets=(secret,),
    )
    target = check_target(claimed.url, allow_private=False, resolve=lambda h, p: ["8.8.8.8"])
    now = int(time.time())
    request = prepare(claimed, target, now)
    assert request.headers["webhook-id"] == "wh_stable"
    assert request.headers["webhook-timestamp"] == str(now)
    assert request.headers["host"] == "hooks.example.com"
    event = sdk().webhooks.unwrap(request.body, request.headers, secret=secret)
    assert isinstance(event, BatchExpiredWebhookEvent)
    assert event.data.id == "batch_9"
