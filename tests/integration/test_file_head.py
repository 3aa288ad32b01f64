"""A create reads the head of its input file for the first line's model, not a whole stored
piece (a MiB, read, sent and split on every create: most of a create's cost in the API when one
tenant floods creates, issue 35)."""

from __future__ import annotations

import json

import pytest
from batch_api_support import LiveServer, Tenant, chat_line, jsonl, submit_file

from backfill.batches import FIRST_MODEL_HEAD_BYTES
from backfill.errors import NotFound
from backfill.store import Repository


def test_the_head_of_a_file_is_its_first_bytes_in_one_read_of_no_more(
    repo: Repository, acme: Tenant, other: Tenant
) -> None:
    content = bytes(range(256)) * 64  # 16 KiB over four pieces
    stored = repo.files.create_file(acme.id, "batch", "in.jsonl", content, chunk_bytes=4096)
    assert repo.files.file_head(acme.id, stored.id, 100) == content[:100]
    assert repo.files.file_head(acme.id, stored.id, 4096) == content[:4096]
    # No further than the first piece: a head is never the whole of a large file.
    assert repo.files.file_head(acme.id, stored.id, 10_000) == content[:4096]
    short = repo.files.create_file(acme.id, "batch", "short.jsonl", b"{}\n")
    assert repo.files.file_head(acme.id, short.id, 100) == b"{}\n"
    with pytest.raises(NotFound):
        repo.files.file_head(other.id, stored.id, 100)


def test_a_create_finds_the_model_of_a_first_line_longer_than_the_head(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    # The head holds no complete line: the create reads the file's lines as before.
    long_line = chat_line("long", "x" * (FIRST_MODEL_HEAD_BYTES + 10), model="long-model")
    batch = submit_file(server.client(acme.key), jsonl([long_line, chat_line("b")]))
    assert batch.status == "failed"  # two models in one file: the second line names it
    assert batch.errors is not None
    assert batch.errors.data is not None
    [error] = batch.errors.data
    assert error.line == 2
    assert "long-model" in json.dumps(error.model_dump())
    head_model = submit_file(server.client(acme.key), jsonl([chat_line("a"), chat_line("b")]))
    assert head_model.status != "failed", head_model.errors
