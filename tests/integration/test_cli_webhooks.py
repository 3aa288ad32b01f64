"""``backfill webhooks add/list/remove/deliveries`` against a live API, and a delivery the
secret printed by ``add`` verifies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from batch_api_support import LiveServer, Tenant, api_settings, chat_file, make_tenant, serve
from openai import OpenAI
from typer.testing import CliRunner
from webhook_receiver import Receiver, listening, new_receiver

from backfill.config import Settings
from backfill.store import Repository
from backfill.webhooks.delivery import Sender
from backfill.webhooks.store import WebhookStore
from backfill_cli.app import app


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    with serve(api_settings(settings, webhooks_allow_private=True)) as live:
        yield live


@pytest.fixture
def acme(repo: Repository) -> Tenant:
    return make_tenant(repo, "acme")


def cli(server: LiveServer, key: str, *args: str) -> tuple[int, str, str]:
    env = {"BACKFILL_API_URL": server.base_url, "BACKFILL_API_KEY": key, "COLUMNS": "200"}
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_add_list_deliveries_remove(
    server: LiveServer, acme: Tenant, repo: Repository, settings: Settings
) -> None:
    receiver: Receiver = new_receiver()
    code, stdout, stderr = cli(
        server, acme.key, "webhooks", "add", receiver.url, "--events", "batch.cancelled"
    )
    assert code == 0, stderr
    secret = stdout.strip().splitlines()[-1]
    assert secret.startswith("whsec_")
    endpoint_id = stdout.split()[2]
    assert endpoint_id.startswith("we_")

    code, stdout, _ = cli(server, acme.key, "webhooks", "list")
    assert code == 0
    assert endpoint_id in stdout
    assert "batch.cancelled" in stdout
    assert secret not in stdout

    client = server.client(acme.key)
    upload = client.files.create(file=("in.jsonl", chat_file(2)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    client.batches.cancel(batch.id)
    sender = Sender(WebhookStore(repo.engine), server.settings)
    try:
        with listening(receiver):
            assert sender.run_round().delivered == 1
    finally:
        sender.close()
    [got] = receiver.received
    event = OpenAI(api_key="unused").webhooks.unwrap(got.body, got.headers, secret=secret)
    assert event.data.id == batch.id

    code, stdout, _ = cli(server, acme.key, "webhooks", "deliveries", "--endpoint", endpoint_id)
    assert code == 0
    assert got.webhook_id in stdout
    assert "delivered" in stdout
    assert "HTTP 200" in stdout

    code, stdout, _ = cli(server, acme.key, "webhooks", "remove", endpoint_id)
    assert code == 0
    code, stdout, _ = cli(server, acme.key, "webhooks", "list")
    assert "no webhook endpoints" in stdout


def test_a_refused_target_and_an_unknown_event_are_one_line_errors(
    acme: Tenant, settings: Settings
) -> None:
    with serve(api_settings(settings)) as strict:
        code, _, stderr = cli(strict, acme.key, "webhooks", "add", "http://10.0.0.1/hook")
        assert code == 1
        assert stderr.strip().count("\n") == 0
        assert "private address" in stderr
        code, _, stderr = cli(
            strict, acme.key, "webhooks", "add", "https://93.184.215.14/", "--events", "nope"
        )
        assert code == 1
        assert "unknown event type 'nope'" in stderr
        code, _, stderr = cli(strict, acme.key, "webhooks", "remove", "we_missing")
        assert code == 1
        assert "not found (404)" in stderr
