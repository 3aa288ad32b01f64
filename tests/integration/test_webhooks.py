"""Webhooks end to end: endpoints through the unmodified openai SDK, the outbox in the
transaction that ends a batch, and deliveries to a real HTTP receiver (down for a while,
a sender killed mid-send, the API restarted, several senders at once)."""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import openai
import pytest
from batch_api_support import (
    LiveServer,
    Tenant,
    api_settings,
    chat_file,
    make_tenant,
    run_worker,
    serve,
)
from openai import OpenAI
from openai.types.webhooks import BatchCancelledWebhookEvent, BatchCompletedWebhookEvent
from sqlalchemy import text
from webhook_receiver import Receiver, dripping, listening, new_receiver

from backfill import batches
from backfill.config import Settings
from backfill.errors import StaleWrite
from backfill.finalize import finalize_ready_jobs, recover_stale_validating
from backfill.refusals import InvalidRequest
from backfill.states import JobState
from backfill.store import JobRecord, Repository
from backfill.store.jobs import move_job as _move_job
from backfill.webhooks.delivery import RoundReport, Sender, SenderThread
from backfill.webhooks.endpoints import add_endpoint
from backfill.webhooks.retry import DeliveryState
from backfill.webhooks.store import EndpointRecord, WebhookStore


@pytest.fixture
def store(repo: Repository) -> WebhookStore:
    return WebhookStore(repo.engine)


@pytest.fixture
def receiver() -> Receiver:
    return new_receiver()


def submit(repo: Repository, settings: Settings, tenant: Tenant, lines: int = 2) -> JobRecord:
    record = repo.tenants.tenant_for_key(tenant.key)
    assert record is not None
    upload = batches.upload_file(
        repo, settings, tenant.id, filename="in.jsonl", purpose="batch", content=chat_file(lines)
    )
    request = batches.BatchRequest(upload.id, "/v1/chat/completions", "24h")
    return batches.create_batch(repo, settings, record, request)


def complete(repo: Repository, settings: Settings, tenant: Tenant) -> str:
    job = submit(repo, settings, tenant)
    run_worker(repo)
    assert finalize_ready_jobs(repo) == {job.id: JobState.COMPLETED}
    return job.id


class HookedJob(NamedTuple):
    tenant: Tenant
    endpoint: EndpointRecord
    secret: str
    job_id: str


def hooked_job(
    repo: Repository,
    store: WebhookStore,
    settings: Settings,
    receiver: Receiver,
    name: str = "acme",
) -> HookedJob:
    """Tenant ``name`` with an endpoint for every batch event at ``receiver``, and a job of
    theirs completed (its event queued for delivery)."""
    tenant = make_tenant(repo, name)
    endpoint, secret = add_endpoint(store, settings, tenant.id, url=receiver.url)
    return HookedJob(tenant, endpoint, secret, complete(repo, settings, tenant))


def rounds_until(
    sender: Sender, done: Callable[[RoundReport], bool], timeout_s: float = 20.0
) -> list[RoundReport]:
    reports: list[RoundReport] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = sender.run_round()
        reports.append(report)
        if done(report):
            return reports
        time.sleep(0.05)
    raise AssertionError(f"not done in {timeout_s} s: {reports}")


def delivered(report: RoundReport) -> bool:
    return report.delivered > 0


def count(repo: Repository, table: str, job_id: str | None = None) -> int:
    with repo.engine.connect() as conn:
        if job_id is None:
            return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
        return int(
            conn.execute(
                text(
                    f"SELECT count(*) FROM {table} t JOIN webhook_events e ON e.id = "
                    f"{'t.id' if table == 'webhook_events' else 't.event_id'} "
                    "WHERE e.job_id = :j"
                ),
                {"j": job_id},
            ).scalar_one()
        )


@pytest.fixture
def sender(store: WebhookStore, hook_settings: Settings) -> Iterator[Sender]:
    s = Sender(store, hook_settings)
    yield s
    s.close()


# -- endpoints through the SDK ------------------------------------------------------------------


@pytest.fixture
def live(hook_settings: Settings) -> Iterator[LiveServer]:
    with serve(hook_settings) as server:
        yield server


def test_the_sdk_creates_lists_updates_rotates_and_deletes_endpoints(
    repo: Repository, live: LiveServer, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    client = live.client(tenant.key)
    created = client.webhooks.create(
        url=receiver.url, name="ops", event_types=["batch.completed", "batch.failed"]
    )
    assert created.id.startswith("we_")
    assert created.signing_secret.startswith("whsec_")
    assert created.signing_secret_hint == "whsec_..." + created.signing_secret[-4:]
    assert created.event_types == ["batch.completed", "batch.failed"]
    got = client.webhooks.retrieve(created.id)
    assert got.url == receiver.url
    assert "signing_secret" not in got.model_dump()
    listed = client.webhooks.list()
    assert [e.id for e in listed.data] == [created.id]
    updated = client.webhooks.update(created.id, event_types=["batch.expired"])
    assert updated.event_types == ["batch.expired"]
    rotated = client.webhooks.rotate_secret(created.id)
    assert rotated.signing_secret != created.signing_secret
    assert client.webhooks.event_types.list().data == [
        "batch.completed",
        "batch.failed",
        "batch.expired",
        "batch.cancelled",
        "webhook_endpoint.disabled",
    ]
    other = make_tenant(repo, "other")
    with pytest.raises(openai.NotFoundError):
        live.client(other.key).webhooks.retrieve(created.id)
    deleted = client.webhooks.delete(created.id)
    assert deleted.deleted is True
    assert deleted.object == "webhook_endpoint.deleted"
    assert client.webhooks.list().data == []
    with pytest.raises(openai.AuthenticationError):
        live.client("sk-wrong").webhooks.list()


def test_the_sdk_sends_a_signed_sample_event_and_hears_the_endpoints_answer(
    repo: Repository, live: LiveServer, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    client = live.client(tenant.key)
    created = client.webhooks.create(url=receiver.url, name="ops", event_types=["batch.failed"])
    receiver.statuses.append(418)
    with listening(receiver):
        result = client.webhooks.test(created.id, event_type="batch.failed")
    assert result.object == "webhook_endpoint.test"
    assert result.webhook_endpoint_id == created.id
    assert result.event_type == "batch.failed"
    assert result.status_code == 418
    (got,) = receiver.received
    # Signed as a delivery is: the SDK verifies it with the endpoint's secret.
    event = OpenAI(api_key="unused").webhooks.unwrap(
        got.body, got.headers, secret=created.signing_secret
    )
    assert event.type == "batch.failed"
    # Nothing is recorded: a sample is not a delivery.
    assert count(repo, "webhook_deliveries") == 0
    # An endpoint that does not answer is an error naming it; another tenant's is a 404; an
    # event Backfill never sends is refused.
    with pytest.raises(openai.BadRequestError) as unreachable:
        client.webhooks.test(created.id, event_type="batch.completed")
    assert unreachable.value.code == "webhook_test_failed"
    with pytest.raises(openai.NotFoundError):
        live.client(make_tenant(repo, "other").key).webhooks.test(
            created.id, event_type="batch.completed"
        )
    with pytest.raises(openai.BadRequestError) as unknown:
        client.webhooks.test(created.id, event_type="video.completed")
    assert unknown.value.param == "event_type"


def test_by_default_the_api_refuses_loopback_and_private_targets(
    repo: Repository, settings: Settings
) -> None:
    tenant = make_tenant(repo, "acme")
    with serve(api_settings(settings)) as server:
        client = server.client(tenant.key)
        for url in ("http://127.0.0.1:8080/hook", "http://10.1.2.3/hook", "ftp://example.com/"):
            with pytest.raises(openai.BadRequestError) as refused:
                client.webhooks.create(url=url, name="x", event_types=["batch.completed"])
            assert refused.value.code == "invalid_webhook_url"
            assert refused.value.param == "url"
        with pytest.raises(openai.BadRequestError):
            client.webhooks.create(
                url="https://example.com/", name="x", event_types=["response.completed"]
            )
        assert client.webhooks.list().data == []


def test_a_tenant_may_have_only_so_many_endpoints(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    capped = hook_settings.model_copy(update={"webhooks_max_endpoints": 2})
    for _ in range(2):
        add_endpoint(store, capped, tenant.id, url=receiver.url)
    with pytest.raises(InvalidRequest, match="2 webhook endpoints"):
        add_endpoint(store, capped, tenant.id, url=receiver.url)


# -- the outbox -----------------------------------------------------------------------------------


def test_the_event_exists_exactly_when_the_batch_end_committed(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    add_endpoint(store, hook_settings, tenant.id, url=receiver.url)
    job = submit(repo, hook_settings, tenant)
    run_worker(repo)
    repo.jobs.move_job(job.id, JobState.FINALIZING)

    class Abort(Exception):
        pass

    def end_then_roll_back() -> None:
        with repo.engine.begin() as conn:
            _move_job(conn, job.id, JobState.COMPLETED)
            assert count_in(conn, "webhook_events", job.id) == 1
            raise Abort

    # The end is written and then rolled back: no event, no delivery.
    with pytest.raises(Abort):
        end_then_roll_back()
    assert count(repo, "webhook_events", job.id) == 0
    assert count(repo, "webhook_deliveries", job.id) == 0
    assert repo.jobs.get_job(None, job.id).state is JobState.FINALIZING
    # Committed: one event, one delivery.
    repo.jobs.move_job(job.id, JobState.COMPLETED)
    assert count(repo, "webhook_events", job.id) == 1
    assert count(repo, "webhook_deliveries", job.id) == 1
    # A transition the state machine refuses (nothing leaves completed) writes none.
    for target in (JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED):
        with pytest.raises(StaleWrite):
            repo.jobs.move_job(job.id, target)
    assert count(repo, "webhook_events", job.id) == 1


def count_in(conn: Any, table: str, job_id: str) -> int:
    return int(
        conn.execute(
            text(f"SELECT count(*) FROM {table} WHERE job_id = :j"), {"j": job_id}
        ).scalar_one()
    )


def test_only_endpoints_of_the_tenant_that_want_the_event_get_a_delivery(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    acme, other = make_tenant(repo, "acme"), make_tenant(repo, "other")
    wants = add_endpoint(store, hook_settings, acme.id, url=receiver.url)[0]
    add_endpoint(store, hook_settings, acme.id, url=receiver.url, event_types=["batch.failed"])
    add_endpoint(store, hook_settings, other.id, url=receiver.url)
    job_id = complete(repo, hook_settings, acme)
    log = store.deliveries(acme.id)
    assert [(d.endpoint_id, d.event_type, d.batch_id) for d in log] == [
        (wants.id, "batch.completed", job_id)
    ]
    assert store.deliveries(other.id) == []
    # A tenant without endpoints costs no event at all.
    lonely = make_tenant(repo, "lonely")
    lonely_job = complete(repo, hook_settings, lonely)
    assert count(repo, "webhook_events", lonely_job) == 0


# -- deliveries to a real receiver --------------------------------------------------------------


def test_a_completed_batch_reaches_the_endpoint_and_the_sdk_verifies_it(
    repo: Repository, live: LiveServer, sender: Sender, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    client = live.client(tenant.key)
    endpoint = client.webhooks.create(url=receiver.url, name="ops", event_types=["batch.completed"])
    job_id = complete(repo, live.settings, tenant)
    with listening(receiver):
        rounds_until(sender, delivered)
    [got] = receiver.received
    assert got.path == "/hooks/backfill"
    assert got.headers["content-type"] == "application/json"
    event = OpenAI(api_key="unused").webhooks.unwrap(
        got.body, got.headers, secret=endpoint.signing_secret
    )
    assert isinstance(event, BatchCompletedWebhookEvent)
    assert event.data.id == job_id
    assert event.id.startswith("evt_")
    assert abs(event.created_at - time.time()) < 60
    log = httpx.get(
        f"{live.base_url}/v1/webhook_deliveries",
        headers={"Authorization": f"Bearer {tenant.key}"},
        params={"batch_id": job_id},
    ).json()["data"]
    assert [(d["id"], d["status"], d["attempts"], d["last_status_code"]) for d in log] == [
        (got.webhook_id, "delivered", 1, 200)
    ]
    assert log[0]["event_id"] == event.id
    assert log[0]["next_attempt_at"] is None
    # Nothing is sent twice.
    assert sender.run_round().claimed == 0


def test_an_endpoint_down_for_a_while_gets_the_event_once_it_is_up_with_the_same_id(
    repo: Repository,
    store: WebhookStore,
    hook_settings: Settings,
    sender: Sender,
    receiver: Receiver,
) -> None:
    tenant, _, secret, job_id = hooked_job(repo, store, hook_settings, receiver)
    # Down: the port refuses connections.
    rounds_until(sender, lambda r: r.retrying > 0)
    rounds_until(sender, lambda r: r.retrying > 0)
    [pending] = store.deliveries(tenant.id)
    assert pending.state is DeliveryState.PENDING
    assert pending.attempts == 2
    assert pending.last_status_code is None
    assert pending.last_error is not None
    assert "Connect" in pending.last_error
    assert pending.next_attempt_at is not None
    # Up, but failing: 503 twice, then it takes the event.
    receiver.statuses = [503, 503]
    with listening(receiver):
        rounds_until(sender, delivered)
    ids = receiver.ids()
    assert len(ids) == 3
    assert set(ids) == {pending.webhook_id}
    for got in receiver.received:
        event = OpenAI(api_key="unused").webhooks.unwrap(got.body, got.headers, secret=secret)
        assert event.data.id == job_id
    assert len({got.body for got in receiver.received}) == 1
    [done] = store.deliveries(tenant.id)
    assert (done.state, done.attempts, done.last_status_code) == (DeliveryState.DELIVERED, 5, 200)
    assert done.last_error is None


def test_a_delivery_that_fails_for_the_whole_retry_period_is_marked_failed(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    tenant = hooked_job(repo, store, hook_settings, receiver).tenant
    brief = hook_settings.model_copy(update={"webhooks_retry_for_s": 1.0})
    receiver.default_status = 500
    sender = Sender(store, brief)
    try:
        with listening(receiver):
            rounds_until(sender, lambda r: r.failed > 0)
    finally:
        sender.close()
    [failed] = store.deliveries(tenant.id)
    assert failed.state is DeliveryState.FAILED
    assert failed.last_status_code == 500
    assert failed.failed_at is not None
    assert failed.attempts == len(receiver.received) >= 2
    assert sender.run_round().claimed == 0


def test_a_receiver_that_drips_its_answer_is_cut_off_at_the_deadline_of_one_attempt(
    repo: Repository, store: WebhookStore, hook_settings: Settings
) -> None:
    # Each byte comes within the read timeout; the answer never within the attempt's
    # deadline (webhooks_timeout_s, 2 s here): a send per read held the round, and every
    # other tenant's delivery in it, for the whole drip.
    tenant = make_tenant(repo, "acme")
    sender = Sender(store, hook_settings)
    try:
        with dripping(every_s=0.25, for_s=60) as url:
            add_endpoint(store, hook_settings, tenant.id, url=url)
            complete(repo, hook_settings, tenant)
            started = time.monotonic()
            report = sender.run_round()
            took = time.monotonic() - started
    finally:
        sender.close()
    assert report.retrying == 1
    assert took < 2.0 + 8.0, took  # the deadline, and room for a busy machine
    [pending] = store.deliveries(tenant.id)
    assert pending.last_error is not None
    assert "no whole answer within 2 s" in pending.last_error


def test_a_dripping_endpoint_holds_its_own_send_slots_not_another_tenants_delivery(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    # Four send slots, two per endpoint at most. Tenant A's endpoint drips its answers (each
    # attempt ends at the 2 s deadline); tenant B's event comes once A's are in flight. B's
    # delivery must not wait for a round of A's to end: it goes out while A's first attempts
    # are still unanswered, and A never has more than two in flight.
    settings = hook_settings.model_copy(
        update={"webhooks_claim_batch": 4, "webhooks_per_endpoint": 2}
    )
    a = make_tenant(repo, "a")
    b = make_tenant(repo, "b")
    a_jobs = []
    stop = threading.Event()
    sender = Sender(store, settings)
    thread = threading.Thread(target=sender.run, args=(stop,), daemon=True)
    try:
        with dripping(every_s=0.25, for_s=60) as url, listening(receiver):
            add_endpoint(store, settings, a.id, url=url)
            add_endpoint(store, settings, b.id, url=receiver.url)
            a_jobs = [complete(repo, settings, a) for _ in range(5)]
            thread.start()
            deadline = time.monotonic() + 60
            while _attempted(repo, a_jobs) < 2:
                assert time.monotonic() < deadline, "A's deliveries were never claimed"
                time.sleep(0.02)
            complete(repo, settings, b)
            assert receiver.got_one.wait(60), "B's delivery never came"
            a_answered = _answered(repo, a_jobs)
            a_attempted = _attempted(repo, a_jobs)
    finally:
        stop.set()
        thread.join(30)
        sender.close()
    assert a_answered == 0, "B's delivery waited for A's attempts to end"
    assert a_attempted <= 2
    assert len(receiver.received) == 1


def _attempted(repo: Repository, job_ids: list[str]) -> int:
    return _deliveries_where(repo, job_ids, "d.attempts > 0")


def _answered(repo: Repository, job_ids: list[str]) -> int:
    return _deliveries_where(repo, job_ids, "d.last_error IS NOT NULL OR d.state <> 'pending'")


def _deliveries_where(repo: Repository, job_ids: list[str], condition: str) -> int:
    with repo.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT count(*) FROM webhook_deliveries d JOIN webhook_events e "
                    f"ON e.id = d.event_id WHERE e.job_id = ANY(:j) AND ({condition})"
                ),
                {"j": job_ids},
            ).scalar_one()
        )


def test_an_endpoint_failing_too_long_is_disabled_and_enabled_again_by_its_tenant(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    settings = hook_settings.model_copy(update={"webhooks_disable_after_s": 1.0})
    hooked = hooked_job(repo, store, settings, receiver)
    receiver.default_status = 500
    sender = Sender(store, settings)
    try:
        with listening(receiver), serve(settings) as server:
            client = server.client(hooked.tenant.key)
            deadline = time.monotonic() + 60
            while store.endpoint(hooked.tenant.id, hooked.endpoint.id).disabled_at is None:
                assert time.monotonic() < deadline, "never disabled"
                sender.run_round()
                time.sleep(0.1)
            seen = client.webhooks.retrieve(hooked.endpoint.id).model_dump()
            assert seen["status"] == "disabled"
            assert "every attempt failed since" in seen["disabled_reason"]
            assert "500" in seen["disabled_reason"]
            # Nothing more is sent to it, though its delivery is still pending and due.
            tried = len(receiver.received)
            time.sleep(0.6)
            assert sender.run_round().claimed == 0
            assert len(receiver.received) == tried
            [pending] = store.deliveries(hooked.tenant.id)
            assert pending.state is DeliveryState.PENDING
            # Its tenant enables it again; the next attempt is delivered and it is healthy.
            receiver.default_status = 200
            enabled = client.webhooks.update(hooked.endpoint.id, extra_body={"status": "enabled"})
            assert enabled.model_dump()["status"] == "enabled"
            reports = rounds_until(sender, delivered)
    finally:
        sender.close()
    assert reports[-1].delivered == 1
    again = store.endpoint(hooked.tenant.id, hooked.endpoint.id)
    assert again.failing_since is None
    assert again.disabled_at is None


def test_healthy_endpoints_deliveries_are_claimed_before_a_failing_ones(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    failing = hooked_job(repo, store, hook_settings, receiver)
    healthy = hooked_job(repo, store, hook_settings, new_receiver(), name="other")
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE webhook_endpoints SET failing_since = now() WHERE id = :e"),
            {"e": failing.endpoint.id},
        )
    # The failing endpoint's delivery is the older one; the healthy one's goes first, and a
    # failing endpoint gets none of the room left for failing ones when there is none.
    (first,) = store.claim_due(1, 5.0)
    assert first.endpoint_id == healthy.endpoint.id
    assert store.claim_due(1, 5.0, failing_room=0) == []
    (last,) = store.claim_due(1, 5.0)
    assert last.endpoint_id == failing.endpoint.id
    assert last.failing


def test_a_target_that_turned_private_is_not_sent_to(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    tenant = hooked_job(repo, store, hook_settings, receiver).tenant
    strict = Sender(store, hook_settings.model_copy(update={"webhooks_allow_private": False}))
    try:
        with listening(receiver):
            report = strict.run_round()
    finally:
        strict.close()
    assert report.retrying == 1
    assert receiver.received == []
    [pending] = store.deliveries(tenant.id)
    assert pending.last_error is not None
    assert "loopback" in pending.last_error


def test_a_sender_killed_mid_send_is_redelivered_with_the_same_id(
    repo: Repository,
    store: WebhookStore,
    hook_settings: Settings,
    sender: Sender,
    receiver: Receiver,
) -> None:
    tenant, _, secret, job_id = hooked_job(repo, store, hook_settings, receiver)
    receiver.hold.clear()  # the first request gets no answer while the sender lives
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": hook_settings.database_url,
        "BACKFILL_WEBHOOKS_ALLOW_PRIVATE": "true",
        "BACKFILL_WEBHOOKS_TIMEOUT_S": "2",
        "BACKFILL_WEBHOOKS_LEASE_S": "5",
        "BACKFILL_WEBHOOKS_POLL_S": "0.1",
    }
    with listening(receiver):
        process = subprocess.Popen([sys.executable, "-m", "backfill.webhooks"], env=env)
        try:
            assert receiver.got_one.wait(30), "the sender never reached the endpoint"
        finally:
            process.send_signal(signal.SIGKILL)
            process.wait(10)
        receiver.hold.set()
        [held] = store.deliveries(tenant.id)
        assert held.state is DeliveryState.PENDING  # the killed sender recorded nothing
        started = time.monotonic()
        rounds_until(sender, delivered)
        # Only once the dead sender's lease ran out.
        assert time.monotonic() - started > 1.0
    ids = receiver.ids()
    assert ids == [held.webhook_id, held.webhook_id]
    last = receiver.received[-1]
    event = OpenAI(api_key="unused").webhooks.unwrap(last.body, last.headers, secret=secret)
    assert event.data.id == job_id
    [done] = store.deliveries(tenant.id)
    assert (done.state, done.attempts) == (DeliveryState.DELIVERED, 2)


def test_a_batch_cancelled_through_the_api_is_delivered_after_the_api_restarts(
    repo: Repository, hook_settings: Settings, sender: Sender, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    with serve(hook_settings) as first:
        client = first.client(tenant.key)
        endpoint = client.webhooks.create(
            url=receiver.url, name="ops", event_types=["batch.cancelled"]
        )
        upload = client.files.create(file=("in.jsonl", chat_file(3)), purpose="batch")
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert client.batches.cancel(batch.id).status == "cancelled"
    # The API is gone before any delivery was tried; the event is in Postgres.
    with listening(receiver):
        rounds_until(sender, delivered)
    with serve(hook_settings) as second:
        log = httpx.get(
            f"{second.base_url}/v1/webhook_deliveries",
            headers={"Authorization": f"Bearer {tenant.key}"},
        ).json()["data"]
    [got] = receiver.received
    event = OpenAI(api_key="unused").webhooks.unwrap(
        got.body, got.headers, secret=endpoint.signing_secret
    )
    assert isinstance(event, BatchCancelledWebhookEvent)
    assert event.data.id == batch.id
    assert [(d["id"], d["status"], d["event_type"]) for d in log] == [
        (got.webhook_id, "delivered", "batch.cancelled")
    ]


def test_senders_running_at_once_send_each_delivery_once(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    for _ in range(3):
        add_endpoint(store, hook_settings, tenant.id, url=receiver.url)
    jobs = [complete(repo, hook_settings, tenant) for _ in range(4)]
    expected = {d.webhook_id for d in store.deliveries(tenant.id, limit=100)}
    assert len(expected) == 3 * len(jobs)
    small = hook_settings.model_copy(update={"webhooks_claim_batch": 2})
    senders = [Sender(store, small) for _ in range(4)]
    barrier = threading.Barrier(len(senders))

    def drain(s: Sender) -> None:
        barrier.wait()
        while s.run_round().claimed:
            pass

    with listening(receiver):
        threads = [threading.Thread(target=drain, args=(s,)) for s in senders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for s in senders:
        s.close()
    ids = receiver.ids()
    assert sorted(ids) == sorted(expected)
    assert all(d.state is DeliveryState.DELIVERED for d in store.deliveries(tenant.id, limit=100))


def test_removing_an_endpoint_stops_its_deliveries(
    repo: Repository,
    store: WebhookStore,
    hook_settings: Settings,
    sender: Sender,
    receiver: Receiver,
) -> None:
    tenant, endpoint, _, _ = hooked_job(repo, store, hook_settings, receiver)
    store.delete_endpoint(tenant.id, endpoint.id)
    with listening(receiver):
        assert sender.run_round().claimed == 0
    assert receiver.received == []


def test_the_sender_thread_of_the_beat_process_delivers_until_stopped(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    tenant = make_tenant(repo, "acme")
    add_endpoint(store, hook_settings, tenant.id, url=receiver.url)
    thread = SenderThread(hook_settings).start()
    try:
        with listening(receiver):
            job_id = complete(repo, hook_settings, tenant)
            assert receiver.got_one.wait(20)
    finally:
        thread.stop()
    [got] = receiver.received
    assert got.body.count(job_id.encode()) == 1


def test_an_https_target_is_reached_at_its_checked_address_and_verified_by_its_name(
    repo: Repository,
    store: WebhookStore,
    hook_settings: Settings,
    receiver: Receiver,
    tmp_path: Path,
) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=hooks.test",
            "-addext",
            "subjectAltName=DNS:hooks.test",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    trusted = ssl.create_default_context(cafile=str(cert))
    looked_up: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return ["127.0.0.1"] if host == "hooks.test" else []

    tenant = make_tenant(repo, "acme")
    url = f"https://hooks.test:{receiver.port}/in"
    _, secret = add_endpoint(store, hook_settings, tenant.id, url=url, resolve=resolve)
    # The certificate names hooks.test, not 127.0.0.1: only a send that connects to the
    # address but checks the name (TLS SNI and hostname) gets through.
    sender = Sender(store, hook_settings, resolve=resolve, verify=trusted)
    untrusting = Sender(store, hook_settings, resolve=resolve)
    try:
        complete(repo, hook_settings, tenant)
        with listening(receiver, tls=server_tls):
            refused = untrusting.run_round()
            assert refused.retrying == 1
            time.sleep(hook_settings.webhooks_retry_max_delay_s)
            rounds_until(sender, delivered)
    finally:
        sender.close()
        untrusting.close()
    assert set(looked_up) == {"hooks.test"}
    [got] = receiver.received
    assert got.headers["host"] == f"hooks.test:{receiver.port}"
    OpenAI(api_key="unused").webhooks.verify_signature(got.body, got.headers, secret=secret)
    [done] = store.deliveries(tenant.id)
    assert done.attempts == 2


def test_after_a_rotation_that_keeps_the_old_secret_both_secrets_verify_a_delivery(
    repo: Repository,
    store: WebhookStore,
    hook_settings: Settings,
    sender: Sender,
    receiver: Receiver,
) -> None:
    tenant = make_tenant(repo, "acme")
    endpoint, old = add_endpoint(store, hook_settings, tenant.id, url=receiver.url)
    _, new = store.rotate_secret(tenant.id, endpoint.id, keep_old_for_s=3600)
    complete(repo, hook_settings, tenant)
    with listening(receiver):
        rounds_until(sender, delivered)
    [got] = receiver.received
    for secret in (old, new):
        OpenAI(api_key="unused").webhooks.verify_signature(got.body, got.headers, secret=secret)
    # Rotated without keeping it: the old secret no longer verifies.
    _, newest = store.rotate_secret(tenant.id, endpoint.id)
    complete(repo, hook_settings, tenant)
    with listening(receiver):
        rounds_until(sender, delivered)
    last = receiver.received[-1]
    OpenAI(api_key="unused").webhooks.verify_signature(last.body, last.headers, secret=newest)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        OpenAI(api_key="unused").webhooks.verify_signature(last.body, last.headers, secret=new)


def test_a_rotated_out_secret_is_cleared_once_its_window_ends(
    repo: Repository, store: WebhookStore, sender: Sender, hook_settings: Settings
) -> None:
    tenant = make_tenant(repo, "acme")
    endpoint, old = add_endpoint(store, hook_settings, tenant.id, url="http://127.0.0.1:9/x")
    store.rotate_secret(tenant.id, endpoint.id, keep_old_for_s=3600)
    kept = "SELECT previous_secret FROM webhook_endpoints WHERE id = :i"
    with repo.engine.begin() as conn:
        assert conn.execute(text(kept), {"i": endpoint.id}).scalar_one() == old
        sender.run_round()  # inside its window: kept
        assert conn.execute(text(kept), {"i": endpoint.id}).scalar_one() == old
        conn.execute(
            text(
                "UPDATE webhook_endpoints SET previous_secret_until = now() - interval '1 s' "
                "WHERE id = :i"
            ),
            {"i": endpoint.id},
        )
    # A sender clears them at its first round, then once a minute: a fresh one here.
    later = Sender(store, hook_settings)
    try:
        later.run_round()
    finally:
        later.close()
    with repo.engine.connect() as conn:
        assert conn.execute(text(kept), {"i": endpoint.id}).scalar_one() is None


def test_a_batch_failed_by_the_stale_validating_recovery_is_an_event_too(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    # An API that died mid-create leaves the batch validating with no items; maintenance
    # fails it in its own statement, and its webhooks must hear of that end like any other.
    tenant = make_tenant(repo, "acme")
    add_endpoint(store, hook_settings, tenant.id, url=receiver.url)
    upload = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        tenant.id, upload.id, "/v1/chat/completions", "24h", repo.now() + timedelta(hours=1)
    )
    recovered = recover_stale_validating(
        repo, older_than_s=0, now=repo.now() + timedelta(seconds=1)
    )
    assert recovered == {job.id: JobState.FAILED}
    log = store.deliveries(tenant.id)
    assert [(d.event_type, d.batch_id) for d in log] == [("batch.failed", job.id)]


def test_an_idle_sender_delivers_at_once_when_a_batch_ends_not_at_its_next_poll(
    repo: Repository, store: WebhookStore, hook_settings: Settings, receiver: Receiver
) -> None:
    # A poll of a minute: only the doorbell (NOTIFY in the transaction that ends the batch)
    # can bring the delivery within seconds.
    settings = hook_settings.model_copy(update={"webhooks_poll_s": 60.0})
    tenant = make_tenant(repo, "acme")
    add_endpoint(store, settings, tenant.id, url=receiver.url)
    thread = SenderThread(settings).start()
    try:
        with listening(receiver):
            time.sleep(1.5)  # past its first look: idle, waiting on its poll
            complete(repo, settings, tenant)
            assert receiver.got_one.wait(15), "delivered only at the poll"
            # Its listening connection lost: it listens again and looks at once.
            receiver.got_one.clear()
            with repo.engine.begin() as conn:
                killed = conn.execute(
                    text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE query LIKE 'LISTEN backfill_webhooks%' "
                        "AND datname = current_database()"
                    )
                ).scalar_one()
            assert killed >= 1
            complete(repo, settings, tenant)
            assert receiver.got_one.wait(15), "not delivered after the doorbell's reconnect"
    finally:
        thread.stop()
    assert len(receiver.received) == 2
