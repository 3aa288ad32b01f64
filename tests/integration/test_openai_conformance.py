"""What the unmodified openai SDK relies on beyond the happy path, against a live API: a
request id on every answer, no retries of answers that cannot change, the param that names
what was missing."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from batch_api_support import (
    LiveServer,
    Tenant,
    api_settings,
    chat_file,
    chat_line,
    run_worker,
    serve,
    submit_file,
)
from sqlalchemy import text

from backfill.config import Settings
from backfill.finalize import finalize_ready_jobs
from backfill.store import Repository
from tests.integration.claiming import claim


def _is_request_id(value: str | None) -> bool:
    return value is not None and value.startswith("req_") and len(value) == 36


def test_every_answer_carries_its_own_request_id(server: LiveServer, acme: Tenant) -> None:
    client = server.client(acme.key)
    raw = client.files.with_raw_response.create(file=("in.jsonl", chat_file(1)), purpose="batch")
    first = raw.headers.get("x-request-id")
    assert _is_request_id(first)
    again = client.files.with_raw_response.list()
    assert _is_request_id(again.headers.get("x-request-id"))
    assert again.headers.get("x-request-id") != first
    # Errors too, those the edge answers before any route (no key) included; the SDK puts
    # the id on the exception it raises.
    with pytest.raises(openai.NotFoundError) as missing:
        client.batches.retrieve("batch_nope")
    assert _is_request_id(missing.value.request_id)
    with httpx.Client(base_url=server.base_url) as anonymous:
        refused = anonymous.get("/v1/batches")
    assert refused.status_code == 401
    assert _is_request_id(refused.headers.get("x-request-id"))


def test_a_conflict_tells_the_sdk_not_to_retry(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    # The SDK retries 409s by default; a batch that has ended will not become cancellable.
    client = server.client(acme.key)
    batch = submit_file(client, chat_file(1))
    run_worker(repo)
    finalize_ready_jobs(repo)
    sent: list[httpx.Request] = []
    retrying = openai.OpenAI(
        api_key=acme.key,
        base_url=f"{server.base_url}/v1",
        max_retries=3,
        http_client=httpx.Client(event_hooks={"request": [sent.append]}),
    )
    with pytest.raises(openai.ConflictError) as caught:
        retrying.batches.cancel(batch.id)
    assert caught.value.response.headers.get("x-should-retry") == "false"
    assert len(sent) == 1  # not retried


def test_a_missing_input_file_names_input_file_id(server: LiveServer, acme: Tenant) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        server.client(acme.key).batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert caught.value.param == "input_file_id"
    assert caught.value.code == "not_found"


def test_a_batch_without_max_tokens_runs_with_the_default_reserved(
    server: LiveServer, acme: Tenant
) -> None:
    # OpenAI does not require max_tokens; before, such a file failed whole.
    lines = b"".join(
        json.dumps(
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "tiny-model", "messages": [{"role": "user", "content": "hi"}]},
            }
        ).encode()
        + b"\n"
        for i in range(3)
    )
    client = server.client(acme.key)
    batch = submit_file(client, lines)
    assert batch.status in ("validating", "in_progress")
    body = json.loads(client.batches.with_raw_response.retrieve(batch.id).text)
    assert body["status"] == "in_progress"
    default = server.settings.batch_default_max_tokens
    assert body["backfill"]["tokens"]["total"] == 3 * default


def test_files_list_pages_in_sql_past_the_newest_ten_thousand(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    # Before, the list read the newest 10,000 and paged in memory: older files were unreachable.
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO files (id, tenant_id, purpose, filename, bytes, created_at) "
                "SELECT 'file-old-' || lpad(g::text, 5, '0'), :t, 'batch', 'x.jsonl', 0, "
                "now() - make_interval(secs => 20000 - g) FROM generate_series(1, 10005) g"
            ),
            {"t": acme.id},
        )
    client = server.client(acme.key)
    first = client.files.list(limit=10_000)
    assert len(first.data) == 10_000
    assert first.has_more
    rest = client.files.list(limit=10_000, after=first.data[-1].id)
    assert [f.id for f in rest.data] == [f"file-old-{g:05d}" for g in range(5, 0, -1)]
    assert not rest.has_more
    oldest = client.files.list(limit=3, order="asc")
    assert [f.id for f in oldest.data] == ["file-old-00001", "file-old-00002", "file-old-00003"]
    after = client.files.list(limit=2, order="asc", after="file-old-00003")
    assert [f.id for f in after.data] == ["file-old-00004", "file-old-00005"]
    assert client.files.list(after="file-nope").data == []


def test_expires_after_sets_expires_at_and_an_expired_file_is_gone(
    server: LiveServer, acme: Tenant, repo: Repository, settings: Settings
) -> None:
    client = server.client(acme.key)
    # Without expires_after a batch file expires in 30 days, as at OpenAI.
    kept = client.files.create(file=("a.jsonl", chat_file(1)), purpose="batch")
    assert kept.expires_at == kept.created_at + 30 * 86_400
    short = client.files.create(
        file=("b.jsonl", chat_file(1)),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert short.expires_at == short.created_at + 3600
    assert client.files.retrieve(short.id).expires_at == short.expires_at
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE files SET expires_at = now() - interval '1 s' WHERE id = :i"),
            {"i": short.id},
        )
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(short.id)
    with pytest.raises(openai.NotFoundError):
        client.files.content(short.id)
    assert short.id not in {f.id for f in client.files.list()}
    assert repo.files.delete_expired_files() == [short.id]
    assert client.files.retrieve(kept.id).id == kept.id
    for bad, param in (
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
        ({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.files.create(
                file=("c.jsonl", chat_file(1)),
                purpose="batch",
                expires_after=bad,  # type: ignore[arg-type]
            )
        assert caught.value.param == param


def test_output_expires_after_dates_the_result_files(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    file_id = client.files.create(file=("in.jsonl", chat_file(2)), purpose="batch").id
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    run_worker(repo, fail={"req-1"})
    finalize_ready_jobs(repo)
    done = client.batches.retrieve(batch.id)
    assert done.output_file_id is not None
    assert done.error_file_id is not None
    for result_id in (done.output_file_id, done.error_file_id):
        result = client.files.retrieve(result_id)
        assert result.expires_at == result.created_at + 7200
    with pytest.raises(openai.BadRequestError) as caught:
        client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 10**9},
        )
    assert caught.value.param == "output_expires_after.seconds"


def test_the_batch_object_carries_its_usage(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    batch = submit_file(client, chat_file(3))
    assert batch.usage is not None
    assert (batch.usage.input_tokens, batch.usage.output_tokens) == (0, 0)
    # run_worker's items have 16 prompt and 3 output tokens; the one that fails is not charged.
    run_worker(repo, fail={"req-2"})
    finalize_ready_jobs(repo)
    done = client.batches.retrieve(batch.id)
    assert done.usage is not None
    assert done.usage.input_tokens == 2 * 16
    assert done.usage.output_tokens == 2 * 3
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    assert done.usage.input_tokens_details.cached_tokens == 0
    assert done.usage.output_tokens_details.reasoning_tokens == 0


def _lines(model: str, n: int) -> bytes:
    return b"".join(
        json.dumps(chat_line(f"{model}-{i}", model=model, max_tokens=8)).encode() + b"\n"
        for i in range(n)
    )


def test_a_batch_for_a_model_no_live_node_serves_is_refused_naming_those_served(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    unserved = client.files.create(file=("a.jsonl", _lines("other-model", 1)), purpose="batch")
    # No node is live yet (a fleet starting up): the batch is accepted and waits.
    waiting = client.batches.create(
        input_file_id=unserved.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert waiting.status == "in_progress"
    repo.nodes.upsert_node("n-a", "http://127.0.0.1:1", "model-a", 64, 16, 0)
    repo.nodes.upsert_node("n-b", "http://127.0.0.1:2", "model-b", 64, 16, 0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.batches.create(
            input_file_id=unserved.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert caught.value.code == "model_not_found"
    assert "`model-a`, `model-b`" in caught.value.message
    with httpx.Client(base_url=server.base_url) as http:
        capacity = http.get("/v1/capacity", headers={"Authorization": f"Bearer {acme.key}"}).json()
    assert set(capacity["models"]) == {"model-a", "model-b"}
    assert capacity["models"]["model-a"]["nodes"] == ["n-a"]
    assert capacity["models"]["model-b"]["capacity_tokens"] == 64 * 16
    ok = submit_file(client, _lines("model-b", 1))
    assert ok.status == "in_progress"


def test_a_batch_for_a_model_not_served_for_its_endpoint_is_refused_naming_the_endpoints(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    # A pooling engine mounts /v1/embeddings only; a worker that did not say (None) may
    # serve anything.
    repo.nodes.upsert_node("n-e", "http://127.0.0.1:1", "embed-a", 64, 16, 0, ["/v1/embeddings"])
    repo.nodes.upsert_node("n-g", "http://127.0.0.1:2", "gen-a", 64, 16, 0, None)
    chat = client.files.create(file=("a.jsonl", _lines("embed-a", 1)), purpose="batch")
    with pytest.raises(openai.NotFoundError) as caught:
        client.batches.create(
            input_file_id=chat.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert "`embed-a` is not served for /v1/chat/completions" in caught.value.message
    assert "served for: /v1/embeddings" in caught.value.message
    embed_line = {
        "custom_id": "e",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": "embed-a", "input": "the fox"},
    }
    accepted = submit_file(client, json.dumps(embed_line).encode() + b"\n", "/v1/embeddings")
    assert accepted.status == "in_progress"
    ok = submit_file(client, _lines("gen-a", 1))
    assert ok.status == "in_progress"
    with httpx.Client(base_url=server.base_url) as http:
        capacity = http.get("/v1/capacity", headers={"Authorization": f"Bearer {acme.key}"}).json()
    assert capacity["models"]["embed-a"]["endpoints"] == ["/v1/embeddings"]
    assert capacity["models"]["gen-a"]["endpoints"] is None


def test_an_operator_may_let_batches_wait_for_a_model(
    settings: Settings, acme: Tenant, repo: Repository
) -> None:
    repo.nodes.upsert_node("n-a", "http://127.0.0.1:1", "model-a", 64, 16, 0)
    with serve(api_settings(settings, batch_wait_for_model=True)) as live:
        client = live.client(acme.key)
        batch = submit_file(client, _lines("later-model", 1))
    assert batch.status == "in_progress"


def test_nodes_claim_only_the_items_of_the_model_they_serve(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    jobs = {}
    for model in ("model-a", "model-b"):
        upload = client.files.create(file=(f"{model}.jsonl", _lines(model, 4)), purpose="batch")
        jobs[model] = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
    for node, model in (("n-a", "model-a"), ("n-b", "model-b")):
        claimed = claim(repo, node, 100, models=[model])
        assert {c.job_id for c in claimed} == {jobs[model]}, node
        assert len(claimed) == 4
        assert {json.loads(c.body)["model"] for c in claimed} == {model}
    assert claim(repo, "n-c", 100, models=["model-c"]) == []
