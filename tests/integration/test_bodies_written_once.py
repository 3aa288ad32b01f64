"""Request bodies are written once: an item points at its line in the uploaded file's pieces,
a claim reads the body from there, and a batch goes on when its input file is deleted or
expires (the bodies of its unfinished items are copied first). Real Postgres, through the API.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from batch_api_support import (
    LiveServer,
    Tenant,
    api_settings,
    chat_line,
    jsonl,
    run_worker,
    serve,
)
from sqlalchemy import text

from backfill.batch_input import (
    InputLimits,
    LocatedLines,
    ValidatedBatch,
    forecast_tokens_upper_bound,
    validate_batch_input,
)
from backfill.config import Settings
from backfill.errors import NotFound
from backfill.finalize import finalize_ready_jobs
from backfill.store import NewItem, Repository
from backfill.upload_scan import iter_located_lines
from tests.integration.claiming import claim

PIECE = 4096
"""Small pieces, so a file of a few dozen lines lies over several of them."""
DEFAULT_MAX_TOKENS = 77


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    limited = api_settings(
        settings, file_chunk_bytes=PIECE, batch_default_max_tokens=DEFAULT_MAX_TOKENS
    )
    with serve(limited) as live:
        yield live


def _lines() -> list[str]:
    """Request lines, most stored as sent, some that must keep a copy of their body."""
    filler = "a line long enough to need several of them per piece " * 12
    lines = [json.dumps(chat_line(f"plain-{i}", f"{i}: {filler}")) for i in range(30)]
    # Raw UTF-8 text (no escapes) stands for itself.
    lines.append(json.dumps(chat_line("utf8", "naïve café — 東京"), ensure_ascii=False))
    # Surrogate pairs and NUL, escaped (read by the worker, not by Postgres).
    lines.append(json.dumps(chat_line("emoji", "smile \U0001f600")))
    lines.append(json.dumps(chat_line("nul", "before\x00after")))
    # Rewritten bodies: a default written in, a float made an integer.
    no_budget = chat_line("defaulted")
    del no_budget["body"]["max_tokens"]
    lines.append(json.dumps(no_budget))
    lines.append(json.dumps(chat_line("float-budget", max_tokens=12.0)))  # type: ignore[arg-type]
    # Written by hand: spaces, key order and duplicate keys as Python reads them.
    lines.append(
        '{ "custom_id" : "spaced", "method":"POST", "url":"/v1/chat/completions", '
        '"body": {"model": "tiny-model", "max_tokens": 5, "messages": '
        '[{"role": "user", "content": "first"}]}, '
        '"body": {"messages": [{"content": "last", "role": "user"}], '
        '"model": "tiny-model", "max_tokens": 6}}'
    )
    return lines


def _expected_bodies(lines: list[str]) -> dict[str, dict[str, Any]]:
    expected = {}
    for line in lines:
        request = json.loads(line)
        body = request["body"]
        if request["custom_id"] == "defaulted":
            body["max_tokens"] = DEFAULT_MAX_TOKENS
        if request["custom_id"] == "float-budget":
            body["max_tokens"] = 12
        expected[request["custom_id"]] = body
    return expected


def _create(http: httpx.Client, file_id: str) -> dict[str, Any]:
    created = http.post(
        "/v1/batches",
        json={
            "input_file_id": file_id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    assert created.status_code == 200, created.text
    batch: dict[str, Any] = created.json()
    assert batch["status"] == "in_progress", batch
    return batch


def _upload(http: httpx.Client, content: bytes, **form: str) -> str:
    uploaded = http.post(
        "/v1/files",
        files={"file": ("in.jsonl", content)},
        data={"purpose": "batch", **form},
    )
    assert uploaded.status_code == 200, uploaded.text
    file_id: str = uploaded.json()["id"]
    return file_id


def _copied(repo: Repository, job_id: str) -> dict[str, bool]:
    """custom_id -> whether the item holds its own copy of its body."""
    with repo.engine.connect() as conn:
        rows = conn.execute(
            text("SELECT custom_id, body IS NOT NULL FROM items WHERE job_id = :j"),
            {"j": job_id},
        ).all()
    return {r[0]: r[1] for r in rows}


def _claim_bodies(repo: Repository, limit: int = 1000) -> dict[str, dict[str, Any]]:
    return {c.custom_id: json.loads(c.body) for c in claim(repo, "node-bodies", limit)}


def _http(server: LiveServer, tenant: Tenant) -> httpx.Client:
    return httpx.Client(
        base_url=server.base_url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60
    )


def test_items_point_at_their_lines_and_a_claim_reads_each_body_as_sent(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    lines = _lines()
    with _http(server, acme) as http:
        file_id = _upload(http, jsonl(lines))
        batch = _create(http, file_id)
    copied = _copied(repo, batch["id"])
    assert not any(copied[f"plain-{i}"] for i in range(30))
    assert [copied[c] for c in ("utf8", "spaced", "emoji", "nul")] == [False] * 4
    assert [copied[c] for c in ("defaulted", "float-budget")] == [True] * 2
    with repo.engine.connect() as conn:
        pieces = conn.execute(
            text("SELECT count(DISTINCT body_seq) FROM items WHERE job_id = :j"),
            {"j": batch["id"]},
        ).scalar_one()
    assert pieces >= 3
    assert _claim_bodies(repo) == _expected_bodies(lines)


def test_a_file_stored_before_pieces_ended_at_line_ends_still_runs(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    # Pieces of 4,096 bytes cut anywhere: lines over two pieces keep a copy of their body.
    lines = _lines()
    stored = repo.files.create_file(acme.id, "batch", "old.jsonl", jsonl(lines), chunk_bytes=PIECE)
    with _http(server, acme) as http:
        batch = _create(http, stored.id)
    copied = _copied(repo, batch["id"])
    assert 0 < sum(copied[f"plain-{i}"] for i in range(30)) < 30
    assert _claim_bodies(repo) == _expected_bodies(lines)


def _gone_then_run(
    server: LiveServer, acme: Tenant, repo: Repository, remove: Any, **form: str
) -> None:
    """Create a batch, run part of it (some items finished, some left running), remove its
    input file with ``remove(http, file_id)``; the rest still claims the right bodies, and
    the batch completes."""
    lines = _lines()
    expected = _expected_bodies(lines)
    with _http(server, acme) as http:
        file_id = _upload(http, jsonl(lines), **form)
        batch = _create(http, file_id)
        running = run_worker(repo, limit=10, leave_running=3)
        remove(http, file_id)
        assert http.get(f"/v1/files/{file_id}").status_code == 404
        with repo.engine.connect() as conn:
            chunks = conn.execute(
                text("SELECT count(*) FROM file_chunks WHERE file_id = :f"), {"f": file_id}
            ).scalar_one()
            kept = conn.execute(
                text(
                    "SELECT count(*) FROM items WHERE job_id = :j AND body IS NULL "
                    "AND state NOT IN ('succeeded', 'failed', 'expired', 'cancelled')"
                ),
                {"j": batch["id"]},
            ).scalar_one()
        assert chunks == 0
        assert kept == 0, "an unfinished item lost its body with the file"
        # The items left running are requeued (their worker died) and claimed again.
        with repo.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE items SET state = 'queued', lease_id = NULL, fencing_token = NULL "
                    "WHERE id = ANY(:ids)"
                ),
                {"ids": [v[0] for v in running.values()]},
            )
        claimed = _claim_bodies(repo)
        assert set(claimed) == set(expected) - set(_finished(repo, batch["id"]))
        assert set(running) <= set(claimed)
        for custom_id, body in claimed.items():
            assert body == expected[custom_id], custom_id
        with repo.engine.begin() as conn:
            conn.execute(
                text("UPDATE items SET state = 'queued' WHERE job_id = :j AND state = 'reserved'"),
                {"j": batch["id"]},
            )
        run_worker(repo)
        assert finalize_ready_jobs(repo) == {batch["id"]: "completed"}
        done = http.get(f"/v1/batches/{batch['id']}").json()
    assert done["status"] == "completed"
    assert done["request_counts"]["completed"] == len(lines)


def _finished(repo: Repository, job_id: str) -> list[str]:
    with repo.engine.connect() as conn:
        return list(
            conn.execute(
                text("SELECT custom_id FROM items WHERE job_id = :j AND state = 'succeeded'"),
                {"j": job_id},
            ).scalars()
        )


def test_a_batch_goes_on_when_its_input_file_is_deleted(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    def delete(http: httpx.Client, file_id: str) -> None:
        assert http.delete(f"/v1/files/{file_id}").status_code == 200

    _gone_then_run(server, acme, repo, delete)


def test_a_batch_goes_on_when_its_input_file_expires(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    def expire(http: httpx.Client, file_id: str) -> None:
        with repo.engine.begin() as conn:
            conn.execute(
                text("UPDATE files SET expires_at = now() - interval '1 s' WHERE id = :i"),
                {"i": file_id},
            )
        assert repo.files.delete_expired_files() == [file_id]

    _gone_then_run(
        server,
        acme,
        repo,
        expire,
        **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"},
    )


def test_the_upload_records_the_bound_a_create_judges_the_quota_on(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    content = jsonl(_lines())
    with _http(server, acme) as http:
        file_id = _upload(http, content)
    assert repo.files.get_file(acme.id, file_id).tokens_bound == forecast_tokens_upper_bound(
        content
    )


def test_a_delete_during_a_create_waits_for_its_items_and_keeps_their_bodies(
    acme: Tenant, repo: Repository
) -> None:
    # The create holds the file while its items stream in: the delete waits for their
    # commit, then copies their bodies. Without the hold it would delete the pieces under
    # items about to commit (lost bodies), or copy before they were visible.
    content = jsonl(_lines())
    stored = repo.files.create_file(acme.id, "batch", "in.jsonl", content, chunk_bytes=PIECE)
    job = repo.jobs.create_job(
        acme.id, stored.id, "/v1/chat/completions", "24h", repo.now() + timedelta(days=1)
    )
    checked = validate_batch_input(
        LocatedLines(iter_located_lines(repo.files.file_chunks(acme.id, stored.id) or ())),
        "/v1/chat/completions",
        InputLimits(10**6, 10**5, 1000, 32768, 16, default_max_tokens=DEFAULT_MAX_TOKENS),
    )
    assert isinstance(checked, ValidatedBatch)
    deleter = threading.Thread(target=repo.files.delete_file, args=(acme.id, stored.id))

    def items() -> Iterator[NewItem]:
        yield checked.items[0]
        deleter.start()
        time.sleep(0.5)
        assert deleter.is_alive(), "the delete did not wait for the create"
        yield from checked.items[1:]

    assert repo.ingest.insert_items(job.id, items()) == len(checked.items)
    deleter.join(timeout=10)
    assert not deleter.is_alive()
    with repo.engine.connect() as conn:
        missing = conn.execute(
            text("SELECT count(*) FROM items WHERE job_id = :j AND body IS NULL"),
            {"j": job.id},
        ).scalar_one()
    assert missing == 0
    with pytest.raises(NotFound):
        repo.files.get_file(acme.id, stored.id)
