"""A batch's shared prompt prefixes (issue 36) found from its items' token ids and shown in
the Batch object's ``backfill`` field, through the API over a real Postgres."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from batch_api_support import LiveServer, Tenant, chat_line, jsonl, submit_file

from backfill.prefix_pass import find_job_prefixes
from backfill.prefixes import prefix_id
from backfill.store import Repository

BLOCK = 4


class WordTokenizer:
    """A ``/tokenize`` stand-in: a chat rendered as ``role: content`` words, one id a word,
    behind a begin token; it records what it was asked."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.asked: list[Mapping[str, Any]] = []

    def ids(self, text: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 10) for w in text.split()]

    async def tokenize_ids(self, body: Mapping[str, Any], model: str) -> list[int]:
        self.asked.append(body)
        rendered = " ".join(f"{m['role']}: {m['content']}" for m in body["messages"])
        return [1, *self.ids(rendered)]


SUMMARISE = "Summarise the following document in three sentences for a busy reader please"
TRANSLATE = "Translate the following text into French keeping every name as it is written"


def test_a_batch_shows_one_group_per_instruction_its_items_share(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    lines = [
        chat_line("s1", f"{SUMMARISE} doc one is about cats"),
        chat_line("s2", f"{SUMMARISE} doc two is about dogs and more"),
        chat_line("s3", f"{SUMMARISE} doc three"),
        chat_line("t1", f"{TRANSLATE} bonjour"),
        chat_line("t2", f"{TRANSLATE} good morning to all"),
        chat_line("alone", "Write a poem about the sea"),
    ]
    batch = submit_file(server.client(acme.key), jsonl(lines))
    with httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {acme.key}"}
    ) as client:
        before = client.get(f"/v1/batches/{batch.id}").json()
        assert before["backfill"]["prefixes"] == []

        tokenizer = WordTokenizer()
        found = asyncio.run(
            find_job_prefixes(
                tokenizer,
                repo.prefixes,
                batch.id,
                endpoint="/v1/chat/completions",
                model="tiny-model",
                tenant_id=acme.id,
                block_size=BLOCK,
            )
        )
        assert (found.looked_at, found.grouped, found.groups) == (6, 5, 2)
        # The bodies asked are the counting plan's: the chat rendering, with its arguments.
        assert all("messages" in body and "model" not in body for body in tokenizer.asked)

        after = client.get(f"/v1/batches/{batch.id}").json()
        # A list page reads its jobs' groups in one query, and shows the same.
        other = submit_file(server.client(acme.key), jsonl([chat_line("x")]))
        listed = {b["id"]: b for b in client.get("/v1/batches").json()["data"]}
    assert listed[batch.id]["backfill"]["prefixes"] == after["backfill"]["prefixes"]
    assert listed[other.id]["backfill"]["prefixes"] == []
    assert repo.prefixes.prefix_groups_of([batch.id, other.id]) == {
        batch.id: repo.prefixes.prefix_groups(batch.id)
    }
    groups = {g["items"]: g for g in after["backfill"]["prefixes"]}
    assert sorted(groups) == [2, 3]
    # "user:" plus 13 instruction words behind the begin token: 15 tokens, 3 whole blocks.
    summarise_ids = [1, *tokenizer.ids(f"user: {SUMMARISE}")]
    assert groups[3]["blocks"] == 3
    assert groups[3]["id"] == prefix_id(acme.id, "tiny-model", summarise_ids[:12])
    assert groups[2]["blocks"] == 3

    # A second pass looks only at what is left: the items that share nothing.
    again = asyncio.run(
        find_job_prefixes(
            WordTokenizer(),
            repo.prefixes,
            batch.id,
            endpoint="/v1/chat/completions",
            model="tiny-model",
            tenant_id=acme.id,
            block_size=BLOCK,
        )
    )
    assert (again.looked_at, again.recorded) == (1, 0)


def test_recording_refuses_a_prefix_of_no_whole_block(repo: Repository, acme: Tenant) -> None:
    with pytest.raises(ValueError, match="whole block"):
        repo.prefixes.record_prefixes("batch_x", [(1, "p", 0)])
