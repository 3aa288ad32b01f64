"""Responses batches through the Batch API (the openai SDK, a live server, real Postgres):
accepted and stored with their output budget (the default written in) and ``store: false``,
or refused line by line with nothing stored."""

from __future__ import annotations

import json
from typing import Any, Final

import openai
from batch_api_support import (
    LiveServer,
    Tenant,
    assert_refused_line_by_line,
    stored_lines,
    submit_lines,
)
from openai.types import Batch

from backfill.store import Repository

RESPONSES: Final = "/v1/responses"


def line(custom_id: str, url: str = RESPONSES, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "tiny", "input": "a question", "max_output_tokens": 8, **body},
    }


def submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Batch:
    return submit_lines(client, lines, RESPONSES)


def test_a_responses_batch_is_stored_with_its_output_budgets(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    defaulted = line("c", instructions="Be brief.")
    del defaulted["body"]["max_output_tokens"]
    batch = submit(
        client,
        [
            line("a"),
            line("b", input=[{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]),
            defaulted,
        ],
    )
    assert (batch.status, batch.endpoint, batch.model) == ("in_progress", RESPONSES, "tiny")
    assert batch.request_counts is not None
    assert batch.request_counts.total == 3
    rows = stored_lines(repo, batch.id)
    default = server.settings.batch_default_max_tokens
    assert [(r[0], r[1]) for r in rows] == [("a", 8), ("b", 8), ("c", default)]
    assert json.loads(rows[0][2]) == {
        "model": "tiny",
        "input": "a question",
        "max_output_tokens": 8,
        "store": False,
    }
    assert json.loads(rows[2][2])["max_output_tokens"] == default
    extras = client.batches.retrieve(batch.id).model_extra or {}
    assert extras["backfill"]["tokens"]["total"] == 16 + default


def test_every_bad_line_fails_the_batch_naming_line_code_and_param(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    bad = [
        line("a", url="/v1/chat/completions"),
        line("b", stream=True),
        line("c", previous_response_id="resp_1"),
        line("d", store=True),
        line("e", background=True),
        line("f", input=[]),
        line("g", tools=[{"type": "web_search"}]),
        line("h", max_output_tokens=0),
        line("i", max_tokens=8),
    ]
    batch = submit(client, [line("ok"), *bad])
    assert_refused_line_by_line(
        batch,
        repo,
        [
            (2, "mismatched_endpoint", "url"),
            (3, "unsupported_parameter", "body.stream"),
            (4, "unsupported_parameter", "body.previous_response_id"),
            (5, "unsupported_parameter", "body.store"),
            (6, "unsupported_parameter", "body.background"),
            (7, "invalid_input", "body.input"),
            (8, "unsupported_parameter", "body.tools"),
            (9, "invalid_max_tokens", "body.max_output_tokens"),
            (10, "unsupported_parameter", "body.max_tokens"),
        ],
    )
