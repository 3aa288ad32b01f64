"""Embeddings batches through the Batch API (the openai SDK, a live server, real Postgres):
accepted and stored declaring no output, or refused line by line with nothing stored."""

from __future__ import annotations

import json
from typing import Any

import openai
from batch_api_support import (
    LiveServer,
    Tenant,
    assert_refused_line_by_line,
    jsonl,
    stored_lines,
    submit_lines,
)
from openai.types import Batch

from backfill.store import Repository

EMBEDDINGS = "/v1/embeddings"


def line(custom_id: str, url: str = EMBEDDINGS, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": {"model": "tiny-embed", "input": "a line to embed", **body},
    }


def submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Batch:
    return submit_lines(client, lines, EMBEDDINGS)


def test_an_embeddings_batch_is_stored_declaring_no_output(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    batch = submit(client, [line("a"), line("b", input=["one", "two"]), line("c", input=[1, 2])])
    assert (batch.status, batch.endpoint, batch.model) == ("in_progress", EMBEDDINGS, "tiny-embed")
    assert batch.request_counts is not None
    assert batch.request_counts.total == 3
    rows = stored_lines(repo, batch.id)
    assert [(r[0], r[1]) for r in rows] == [("a", 0), ("b", 0), ("c", 0)]
    assert json.loads(rows[1][2]) == {"model": "tiny-embed", "input": ["one", "two"]}
    extras = client.batches.retrieve(batch.id).model_extra or {}
    assert extras["backfill"]["tokens"]["total"] == 0  # no output declared


def test_every_bad_line_fails_the_batch_naming_line_code_and_param(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    bad = [
        line("a", url="/v1/completions"),
        line("b", max_tokens=8),
        line("c", input=[]),
        line("d", encoding_format="bytes"),
        line("e", dimensions=-1),
    ]
    batch = submit(client, [line("ok"), *bad])
    assert_refused_line_by_line(
        batch,
        repo,
        [
            (2, "mismatched_endpoint", "url"),
            (3, "unsupported_parameter", "body.max_tokens"),
            (4, "invalid_input", "body.input"),
            (5, "invalid_parameter", "body.encoding_format"),
            (6, "invalid_parameter", "body.dimensions"),
        ],
    )


def test_a_chat_line_in_an_embeddings_batch_and_back_are_mismatched(
    server: LiveServer, acme: Tenant
) -> None:
    client = server.client(acme.key)
    chat = {
        "custom_id": "x",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "tiny-embed", "messages": [{"role": "user", "content": "hi"}]},
    }
    batch = submit(client, [chat])
    assert batch.errors is not None
    assert batch.errors.data is not None
    assert batch.errors.data[0].code == "mismatched_endpoint"
    upload = client.files.create(file=("c.jsonl", jsonl([line("y")])), purpose="batch")
    other = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert other.errors is not None
    assert other.errors.data is not None
    assert other.errors.data[0].code == "mismatched_endpoint"
