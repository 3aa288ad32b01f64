"""Media content parts through the live API (issue 35): refused in batch and interactive chat
(400 naming the part) unless the deployment opts in; with the opt-in, for the tenants it names,
inline media and URLs to the hosts it names are taken, the rest refused naming why.

Real Postgres and Redis. No engine: a batch's lines are checked and stored at create; an
interactive request the gateway takes on meets no registered node (503), which is enough to
see that it was not refused (its tokens would be counted by the engine's ``/tokenize``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from batch_api_support import (
    LiveServer,
    Tenant,
    api_settings,
    chat_line,
    make_tenant,
    serve,
    stored_lines,
    submit_lines,
)

from backfill.config import Settings
from backfill.store import Repository

CHAT = "/v1/chat/completions"
PNG = "data:image/png;base64," + "iVBORw0KGgo" * 20
HOST = "images.example.com"


def image(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def content(*parts: Any) -> list[dict[str, Any]]:
    return [{"type": "text", "text": "What is in this picture?"}, *parts]


def media_line(custom_id: str, *parts: Any) -> dict[str, Any]:
    line = chat_line(custom_id)
    line["body"]["messages"] = [{"role": "user", "content": content(*parts)}]
    return line


def ask(api: LiveServer, tenant: Tenant, *parts: Any) -> httpx.Response:
    body = {"model": "tiny-model", "messages": [{"role": "user", "content": content(*parts)}]}
    return httpx.post(
        f"{api.base_url}{CHAT}",
        json={**body, "max_tokens": 8},
        headers={"Authorization": f"Bearer {tenant.key}"},
        timeout=30,
    )


@pytest.fixture
def opted_in(settings: Settings) -> Iterator[LiveServer]:
    with serve(
        api_settings(
            settings,
            media_parts=True,
            media_tenants="acme",
            media_allowed_domains=HOST,
            media_max_parts_per_request=2,
        )
    ) as live:
        yield live


def test_without_the_opt_in_media_parts_are_refused_naming_the_part(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    batch = submit_lines(server.client(acme.key), [media_line("a", image(PNG))], CHAT)
    assert batch.status == "failed"
    assert batch.errors is not None
    assert batch.errors.data is not None
    [error] = batch.errors.data
    assert (error.line, error.code, error.param) == (1, "invalid_messages", "body.messages")
    assert (error.message or "").startswith("body.messages[0].content[1] is a part of type")
    assert repo.stats.counted_states(batch.id) == {}
    answer = ask(server, acme, image(PNG))
    assert answer.status_code == 400, answer.text
    refusal = answer.json()["error"]
    assert refusal["param"] == "messages"
    assert refusal["message"].startswith("messages[0].content[1] is a part of type 'image_url'")


def test_with_the_opt_in_a_named_tenants_media_lines_are_stored_as_given(
    opted_in: LiveServer, repo: Repository
) -> None:
    acme = make_tenant(repo, "acme")
    lines = [media_line("inline", image(PNG)), media_line("hosted", image(f"https://{HOST}/a"))]
    batch = submit_lines(opted_in.client(acme.key), lines, CHAT)
    assert batch.status in ("validating", "in_progress"), batch.errors
    stored = {row.custom_id: json.loads(row.body) for row in stored_lines(repo, batch.id)}
    assert stored["inline"]["messages"][0]["content"][1] == image(PNG)
    assert stored["hosted"]["messages"][0]["content"][1] == image(f"https://{HOST}/a")


def test_with_the_opt_in_lines_out_of_bounds_and_other_tenants_are_refused(
    opted_in: LiveServer, repo: Repository
) -> None:
    acme, other = make_tenant(repo, "acme"), make_tenant(repo, "other")
    bad = [
        media_line("metadata", image("http://169.254.169.254/latest/meta-data/")),
        media_line("three", image(PNG), image(PNG), image(PNG)),
        media_line("file", {"type": "file", "file": {"file_id": "file-1"}}),
    ]
    batch = submit_lines(opted_in.client(acme.key), bad, CHAT)
    assert batch.status == "failed"
    assert batch.errors is not None
    assert batch.errors.data is not None
    said = {e.line: e.message or "" for e in batch.errors.data}
    assert "names host '169.254.169.254'" in said[1]
    assert "at most 2 media parts" in said[2]
    assert "a part of type 'file'" in said[3]
    assert repo.stats.counted_states(batch.id) == {}
    theirs = submit_lines(opted_in.client(other.key), [media_line("a", image(PNG))], CHAT)
    assert theirs.status == "failed"


def test_with_the_opt_in_interactive_chat_takes_a_named_tenants_media_and_no_one_elses(
    opted_in: LiveServer, repo: Repository
) -> None:
    acme, other = make_tenant(repo, "acme"), make_tenant(repo, "other")
    # Taken on: no node is registered to count and serve it.
    taken = ask(opted_in, acme, image(PNG))
    assert taken.status_code == 503, taken.text
    far = ask(opted_in, acme, image("http://127.0.0.1:6379/"))
    assert far.status_code == 400
    assert "names host '127.0.0.1'" in far.json()["error"]["message"]
    refused = ask(opted_in, other, image(PNG))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages"
