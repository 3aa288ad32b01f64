"""The Batch API end to end: the real openai SDK against a live server over a real Postgres."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from batch_api_support import (
    LiveServer,
    Tenant,
    api_settings,
    chat_file,
    chat_line,
    jsonl,
    make_tenant,
    result_lines,
    run_worker,
    serve,
)
from openai.types import Batch

from backfill.config import Settings
from backfill.finalize import finalize_ready_jobs, settle_cancelling
from backfill.states import ItemState
from backfill.store import Finish, Repository


def upload(client: openai.OpenAI, content: bytes, name: str = "input.jsonl") -> str:
    return client.files.create(file=(name, content), purpose="batch").id


def submit(client: openai.OpenAI, content: bytes, window: str = "24h", **kwargs: Any) -> Any:
    file_id = upload(client, content)
    return client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window=window,  # type: ignore[arg-type]
        **kwargs,
    )


def http(server: LiveServer, key: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.base_url, headers=headers, timeout=30)


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def test_files_round_trip_through_the_openai_sdk(server: LiveServer, acme: Tenant) -> None:
    client = server.client(acme.key)
    content = chat_file(3)
    created = client.files.create(file=("input.jsonl", content), purpose="batch")
    assert created.object == "file"
    assert created.bytes == len(content)
    assert created.purpose == "batch"
    assert created.status == "processed"
    assert created.filename == "input.jsonl"

    assert client.files.retrieve(created.id).id == created.id
    assert [f.id for f in client.files.list()] == [created.id]
    assert client.files.content(created.id).content == content

    deleted = client.files.delete(created.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(created.id)


def test_upload_refuses_a_purpose_other_than_batch(server: LiveServer, acme: Tenant) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        server.client(acme.key).files.create(file=("x.jsonl", chat_file(1)), purpose="assistants")
    assert err.value.body["param"] == "purpose"  # type: ignore[index]


# ---------------------------------------------------------------------------------------------
# Batches: the life of a batch
# ---------------------------------------------------------------------------------------------


def test_batch_runs_to_completed_with_output_and_error_files(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    batch = submit(client, chat_file(3), metadata={"project": "hamlet"})
    assert batch.object == "batch"
    assert batch.status == "in_progress"
    assert batch.endpoint == "/v1/chat/completions"
    assert batch.completion_window == "24h"
    assert batch.request_counts is not None
    assert batch.request_counts.total == 3
    assert batch.metadata == {"project": "hamlet"}
    assert batch.in_progress_at is not None
    assert batch.expires_at == pytest.approx(batch.created_at + 24 * 3600, abs=2)
    extras = batch.model_extra["backfill"]  # type: ignore[index]
    assert extras["items"]["queued"] == 3
    assert extras["tokens"] == {"done": 0, "total": 3 * 64, "prompt": 0}
    assert extras["eta"] is not None
    assert extras["eta_basis"] == "forecast"

    run_worker(repo, fail={"req-1"})
    assert finalize_ready_jobs(repo) == {batch.id: "completed"}

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    assert done.finalizing_at is not None
    assert done.completed_at is not None
    assert done.output_file_id is not None
    assert done.error_file_id is not None

    output = result_lines(client.files.content(done.output_file_id).text)
    assert [line["custom_id"] for line in output] == ["req-0", "req-2"]
    assert output[0]["error"] is None
    assert output[0]["response"]["status_code"] == 200
    assert output[0]["response"]["body"]["choices"][0]["message"]["content"] == "answer to req-0"

    errors = result_lines(client.files.content(done.error_file_id).text)
    assert [line["custom_id"] for line in errors] == ["req-1"]
    assert errors[0]["response"] is None
    assert errors[0]["error"] == {"code": "engine_error", "message": "the engine said no"}

    output_file = client.files.retrieve(done.output_file_id)
    assert output_file.purpose == "batch_output"
    assert output_file.bytes == len(client.files.content(done.output_file_id).content)


def test_batch_whose_every_request_failed_completes_with_every_request_counted_failed(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    # OpenAI's meaning: the batch ran (completed); request_counts and the error file say that
    # every request failed. "failed" is for a batch that could not start.
    client = server.client(acme.key)
    batch = submit(client, chat_file(2))
    run_worker(repo, fail={"req-0", "req-1"})
    finalize_ready_jobs(repo)

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed"
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.failed) == (2, 2)
    assert done.request_counts.completed == 0
    assert done.output_file_id is None
    assert done.errors is None
    assert done.error_file_id is not None
    assert len(result_lines(client.files.content(done.error_file_id).text)) == 2


def test_results_stream_while_the_batch_runs(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    batch = submit(client, chat_file(4))
    run_worker(repo, fail={"req-1"}, leave_running=1)

    with http(server, acme.key) as h:
        succeeded = h.get(f"/v1/batches/{batch.id}/results", params={"state": "succeeded"})
        assert succeeded.status_code == 200
        assert [r["custom_id"] for r in result_lines(succeeded.text)] == ["req-0", "req-2"]

        everything = h.get(f"/v1/batches/{batch.id}/results")
        assert [r["custom_id"] for r in result_lines(everything.text)] == [
            "req-0",
            "req-1",
            "req-2",
        ]
        both = h.get(f"/v1/batches/{batch.id}/results?state=failed,expired")
        assert [r["custom_id"] for r in result_lines(both.text)] == ["req-1"]

        bad = h.get(f"/v1/batches/{batch.id}/results", params={"state": "running"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "state"

    running = client.batches.retrieve(batch.id)
    assert running.status == "in_progress"
    extras = running.model_extra["backfill"]  # type: ignore[index]
    assert extras["items"]["succeeded"] == 2
    assert extras["items"]["running"] == 1
    assert extras["tokens"]["done"] == 6
    assert extras["eta_basis"] == "observed"


def test_cancel_ends_queued_items_at_once_and_keeps_finished_results(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    batch = submit(client, chat_file(3))
    running = run_worker(repo, limit=2, leave_running=1)  # req-0 succeeds, req-1 runs
    item_id, attempt, fence = running["req-1"]

    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    assert cancelling.cancelling_at is not None
    extras = cancelling.model_extra["backfill"]  # type: ignore[index]
    assert extras["items"]["cancelled"] == 1
    assert extras["items"]["running"] == 1

    # The worker's in-flight request ends; the next periodic settle closes the job.
    repo.items.finish([Finish(item_id, attempt, fence, ItemState.SUCCEEDED, result='{"ok": true}')])
    assert settle_cancelling(repo, batch.id) == "cancelled"

    cancelled = client.batches.retrieve(batch.id)
    assert cancelled.status == "cancelled"
    assert cancelled.cancelled_at is not None
    assert cancelled.request_counts is not None
    assert (cancelled.request_counts.completed, cancelled.request_counts.failed) == (2, 1)
    assert cancelled.output_file_id is not None
    assert cancelled.error_file_id is not None
    errors = result_lines(client.files.content(cancelled.error_file_id).text)
    assert errors == [
        {
            "id": errors[0]["id"],
            "custom_id": "req-2",
            "response": None,
            "error": {"code": "batch_cancelled", "message": errors[0]["error"]["message"]},
        }
    ]
    # Cancel is idempotent once cancelled.
    assert client.batches.cancel(batch.id).status == "cancelled"


def test_cancel_without_in_flight_items_is_cancelled_at_once(
    server: LiveServer, acme: Tenant
) -> None:
    client = server.client(acme.key)
    batch = submit(client, chat_file(2))
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled"
    assert cancelled.output_file_id is None
    assert cancelled.error_file_id is not None


def test_cancel_of_a_finished_batch_is_a_conflict(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    batch = submit(client, chat_file(1))
    run_worker(repo)
    finalize_ready_jobs(repo)
    with pytest.raises(openai.ConflictError) as err:
        client.batches.cancel(batch.id)
    assert err.value.code == "batch_not_cancellable"


def test_list_is_newest_first_and_pages_with_after(server: LiveServer, acme: Tenant) -> None:
    client = server.client(acme.key)
    ids = [submit(client, chat_file(1)).id for _ in range(3)]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == [ids[2], ids[1]]
    assert first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in second.data] == [ids[0]]
    assert not second.has_more
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]


@pytest.mark.parametrize(
    ("window", "seconds"), [("30m", 1800), ("72h", 72 * 3600), ("1h30m", 5400), ("24h", 86400)]
)
def test_completion_windows_other_than_24h_are_accepted(
    server: LiveServer, acme: Tenant, window: str, seconds: int
) -> None:
    batch = submit(server.client(acme.key), chat_file(1), window=window)
    assert batch.status == "in_progress"
    assert batch.completion_window == window
    # The deadline is the window from when the create began; the job row is stamped a
    # moment later (seconds on a loaded machine), never before.
    assert batch.expires_at is not None
    assert batch.created_at + seconds - 30 <= batch.expires_at <= batch.created_at + seconds + 1


# ---------------------------------------------------------------------------------------------
# Validation: bad input fails the batch, line by line; bad parameters are 4xx
# ---------------------------------------------------------------------------------------------

GOOD = chat_line("first")
BASE = chat_line("a")

INVALID_LINES: list[tuple[str, Any, str, str | None]] = [
    ("not json", "{nope", "invalid_json_line", None),
    ("not an object", "[1, 2]", "invalid_json_line", None),
    ("no custom_id", {**BASE, "custom_id": None}, "missing_custom_id", "custom_id"),
    ("custom_id too long", {**BASE, "custom_id": "x" * 513}, "invalid_custom_id", "custom_id"),
    ("method GET", {**BASE, "method": "GET"}, "invalid_method", "method"),
    ("other url", {**BASE, "url": "/v1/completions"}, "mismatched_endpoint", "url"),
    ("body not an object", {**BASE, "body": "hi"}, "invalid_body", "body"),
    ("no model", chat_line("a", model=""), "missing_model", "body.model"),
    ("other model", chat_line("a", model="other-model"), "mismatched_model", "body.model"),
    (
        "no messages",
        {**BASE, "body": {"model": "tiny-model", "max_tokens": 5}},
        "missing_prompt",
        "body.messages",
    ),
    (
        "empty messages",
        {**BASE, "body": {"model": "tiny-model", "messages": [], "max_tokens": 5}},
        "invalid_messages",
        "body.messages",
    ),
    ("zero max_tokens", chat_line("a", max_tokens=0), "invalid_max_tokens", "body.max_tokens"),
    (
        "max_tokens over limit",
        chat_line("a", max_tokens=40_000),
        "max_tokens_too_large",
        "body.max_tokens",
    ),
    ("streaming", chat_line("a", stream=True), "unsupported_parameter", "body.stream"),
    ("n > 1", chat_line("a", n=2), "unsupported_parameter", "body.n"),
]


def test_every_invalid_line_fails_the_batch_and_names_the_line(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    for label, bad, code, param in INVALID_LINES:
        batch = submit(client, jsonl([GOOD, bad]))
        assert batch.status == "failed", label
        assert batch.failed_at is not None, label
        assert batch.errors is not None, label
        assert batch.errors.data is not None, label
        first = batch.errors.data[0]
        assert (first.code, first.line, first.param) == (code, 2, param), label
        assert repo.stats.counted_states(batch.id) == {}, f"{label}: items were stored"


def test_duplicate_custom_ids_are_reported_on_the_repeating_line(
    server: LiveServer, acme: Tenant
) -> None:
    batch = submit(server.client(acme.key), jsonl([chat_line("a"), chat_line("b"), chat_line("a")]))
    assert batch.status == "failed"
    assert batch.errors is not None
    assert batch.errors.data is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 3)]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"completion_window": "soon"}, "completion_window"),
        ({"completion_window": "1m"}, "completion_window"),
        ({"completion_window": "30d"}, "completion_window"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
    ],
)
def test_bad_create_parameters_are_400_naming_the_parameter(
    server: LiveServer, acme: Tenant, kwargs: dict[str, Any], param: str
) -> None:
    client = server.client(acme.key)
    args: dict[str, Any] = {
        "input_file_id": upload(client, chat_file(1)),
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    args.update(kwargs)
    with pytest.raises(openai.BadRequestError) as err:
        client.batches.create(**args)
    assert err.value.body["param"] == param  # type: ignore[index]
    assert err.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_an_unknown_input_file_is_404(server: LiveServer, acme: Tenant) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client(acme.key).batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )


# ---------------------------------------------------------------------------------------------
# Tenants: authentication and isolation
# ---------------------------------------------------------------------------------------------


def test_missing_bad_and_revoked_keys_are_401(
    settings: Settings, acme: Tenant, repo: Repository
) -> None:
    # Keys are remembered for api_key_cache_s: a revoked key stops working within it.
    with serve(api_settings(settings, api_key_cache_s=0.5)) as server:
        with http(server, None) as h:
            missing = h.get("/v1/batches")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            server.client("bf-wrong").batches.list()
        assert server.client(acme.key).batches.list().data == []
        repo.tenants.revoke_api_key(acme.key)
        time.sleep(0.6)
        with pytest.raises(openai.AuthenticationError):
            server.client(acme.key).batches.list()


def test_another_tenants_ids_are_404_on_every_route(
    server: LiveServer, acme: Tenant, other: Tenant, repo: Repository
) -> None:
    mine = server.client(acme.key)
    batch = submit(mine, chat_file(2))
    run_worker(repo)
    finalize_ready_jobs(repo)
    done = mine.batches.retrieve(batch.id)
    assert done.output_file_id is not None
    file_ids = [batch.input_file_id, done.output_file_id]

    theirs = server.client(other.key)
    for file_id in file_ids:
        with pytest.raises(openai.NotFoundError):
            theirs.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            theirs.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            theirs.files.delete(file_id)
    with pytest.raises(openai.NotFoundError):
        theirs.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        theirs.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        theirs.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    with http(server, other.key) as h:
        assert h.get(f"/v1/batches/{batch.id}/results").status_code == 404
    assert theirs.batches.list().data == []
    assert list(theirs.files.list()) == []
    # And nothing of acme's was touched.
    assert mine.files.retrieve(batch.input_file_id).id == batch.input_file_id


# ---------------------------------------------------------------------------------------------
# Idempotency, deadlines, limits, rate limits
# ---------------------------------------------------------------------------------------------


def test_a_retried_create_with_the_same_idempotency_key_returns_the_first_batch(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    client = server.client(acme.key)
    file_id = upload(client, chat_file(2))
    args: dict[str, Any] = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "extra_headers": {"Idempotency-Key": "order-42"},
    }
    first = client.batches.create(**args)
    again = client.batches.create(**args)
    assert again.id == first.id
    assert len(client.batches.list().data) == 1
    assert sum(repo.stats.counted_states(first.id).values()) == 2

    other_file = upload(client, chat_file(1))
    with pytest.raises(openai.ConflictError) as err:
        client.batches.create(**{**args, "input_file_id": other_file})
    assert err.value.code == "idempotency_key_reused"


def test_an_infeasible_deadline_is_refused_with_the_earliest_feasible_window(
    settings: Settings, repo: Repository
) -> None:
    tenant = make_tenant(repo, "acme")
    # 64 output tokens a line at 0.05 tokens/s: about 22 minutes a line.
    with serve(api_settings(settings, batch_throughput_tokens_per_s=0.05)) as server:
        client = server.client(tenant.key)
        file_id = upload(client, chat_file(2))
        with pytest.raises(openai.BadRequestError) as err:
            client.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="30m"
            )
        body: dict[str, Any] = err.value.body  # type: ignore[assignment]
        assert body["code"] == "deadline_infeasible"
        assert body["param"] == "completion_window"
        window = body["earliest_feasible_window"]
        assert window in body["message"]
        assert client.batches.list().data == []

        accepted = client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window=window,  # type: ignore[arg-type]
        )
        assert accepted.status == "in_progress"
        # Its own tokens are now backlog: a second one in the same window no longer fits.
        with pytest.raises(openai.BadRequestError):
            client.batches.create(
                input_file_id=file_id,
                endpoint="/v1/chat/completions",
                completion_window=window,  # type: ignore[arg-type]
            )


def test_size_and_line_limits_are_4xx_at_upload(settings: Settings, repo: Repository) -> None:
    tenant = make_tenant(repo, "acme")
    limited = api_settings(settings, max_file_bytes=2000, max_line_bytes=400, max_lines_per_batch=3)
    with serve(limited) as server, http(server, tenant.key) as h:

        def post(content: bytes) -> httpx.Response:
            return h.post(
                "/v1/files", data={"purpose": "batch"}, files={"file": ("x.jsonl", content)}
            )

        too_big = post(b"x" * 2001)
        assert too_big.status_code == 413
        assert too_big.json()["error"]["code"] == "file_too_large"

        huge = h.post(
            "/v1/files",
            content=b"x" * 100_000,
            headers={"content-type": "multipart/form-data; boundary=x"},
        )
        assert huge.status_code == 413  # refused from Content-Length, before parsing

        long_line = post(jsonl([chat_line("a", content="y" * 500)]))
        assert long_line.status_code == 400
        assert long_line.json()["error"]["code"] == "line_too_long"
        assert "line 1" in long_line.json()["error"]["message"]

        too_many = post(chat_file(4, content="z"))
        assert too_many.status_code == 400
        assert too_many.json()["error"]["code"] == "too_many_lines"

        empty = post(b"\n\n")
        assert empty.status_code == 400
        assert empty.json()["error"]["code"] == "empty_file"

        assert post(chat_file(3, content="z")).status_code == 200


def test_active_batch_limit_and_token_quota_are_429_without_retry(
    settings: Settings, repo: Repository
) -> None:
    limited = make_tenant(repo, "small", quota=200)
    with serve(api_settings(settings, max_active_batches_per_tenant=1)) as server:
        client = server.client(limited.key)
        with pytest.raises(openai.RateLimitError) as quota:
            submit(client, chat_file(4))  # 4 x 64 output tokens > 200
        assert quota.value.code == "enqueued_token_quota_exceeded"
        assert quota.value.response.headers["x-should-retry"] == "false"

        submit(client, chat_file(1))
        with pytest.raises(openai.RateLimitError) as active:
            submit(client, chat_file(1))
        assert active.value.code == "active_batch_limit_reached"


def test_uploads_and_creates_beyond_a_tenants_bound_are_429_and_other_tenants_go_on(
    settings: Settings, repo: Repository
) -> None:
    # One tenant's creates and uploads in progress hold Postgres connections: beyond its
    # bound the next is refused at once (before any work), and another tenant's go on.
    tenant = make_tenant(repo, "acme")
    other = make_tenant(repo, "other")
    with serve(api_settings(settings, max_ingests_per_tenant=1, max_ingests=2)) as server:
        assert server.app is not None
        slots = server.app.state.ingest_slots
        client, others = server.client(tenant.key), server.client(other.key)

        def create(sdk: openai.OpenAI, file_id: str) -> Batch:
            return sdk.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )

        uploaded = client.files.create(file=("a.jsonl", chat_file(2)), purpose="batch")
        with slots.held(tenant.id):  # a create of acme's in progress
            with pytest.raises(openai.RateLimitError) as refused:
                create(client, uploaded.id)
            assert refused.value.code == "too_many_concurrent_ingests"
            assert int(refused.value.response.headers["Retry-After"]) >= 1
            with pytest.raises(openai.RateLimitError):
                client.files.create(file=("b.jsonl", chat_file(2)), purpose="batch")
            # The other tenant's upload and create go on.
            theirs = others.files.create(file=("c.jsonl", chat_file(2)), purpose="batch")
            create(others, theirs.id)
            with slots.held(other.id):  # the API's bound in all (2) reached: a third waits
                third = server.client(make_tenant(repo, "third").key)
                with pytest.raises(openai.RateLimitError) as busy:
                    third.files.create(file=("d.jsonl", chat_file(2)), purpose="batch")
                assert "the API is processing 2" in busy.value.message
        assert slots.in_use() == 0
        # Nothing held: acme's create goes through, and the refused ones stored nothing.
        created = create(client, uploaded.id)
        assert created.status in ("validating", "in_progress")
        assert [f.filename for f in client.files.list()] == ["a.jsonl"]


def test_rate_limit_answers_429_with_retry_after(settings: Settings, repo: Repository) -> None:
    tenant = make_tenant(repo, "acme")
    other = make_tenant(repo, "other")
    with serve(api_settings(settings, rate_limit_per_s=0.2, rate_limit_burst=3)) as server:
        with http(server, tenant.key) as h:
            codes = [h.get("/v1/batches").status_code for _ in range(4)]
            assert codes == [200, 200, 200, 429]
            limited = h.get("/v1/batches")
            assert limited.status_code == 429
            assert int(limited.headers["Retry-After"]) >= 1
            assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        # Buckets are per tenant.
        with http(server, other.key) as h:
            assert h.get("/v1/batches").status_code == 200


# ---------------------------------------------------------------------------------------------
# The edges: error shapes, schema, store outage, capacity
# ---------------------------------------------------------------------------------------------


def test_unknown_routes_and_bad_bodies_answer_in_openai_error_shape(
    server: LiveServer, acme: Tenant
) -> None:
    with http(server, acme.key) as h:
        unknown = h.get("/v1/nothing-here")
        assert unknown.status_code == 404
        assert set(unknown.json()["error"]) == {"message", "type", "param", "code"}

        missing = h.post("/v1/batches", json={"endpoint": "/v1/chat/completions"})
        assert missing.status_code == 400
        assert missing.json()["error"]["type"] == "invalid_request_error"
        assert missing.json()["error"]["param"] == "input_file_id"

        not_json = h.post("/v1/batches", content=b"{", headers={"content-type": "application/json"})
        assert not_json.status_code == 400


def test_openapi_schema_is_served(server: LiveServer) -> None:
    with http(server, None) as h:
        schema = h.get("/openapi.json").json()
    assert {"/v1/files", "/v1/batches", "/v1/batches/{batch_id}/cancel", "/v1/capacity"} <= set(
        schema["paths"]
    )


def test_postgres_down_is_503_with_retry_after(settings: Settings) -> None:
    down = api_settings(settings, database_url="postgresql://postgres@127.0.0.1:1/nowhere")
    with serve(down) as server, http(server, "bf-any") as h:
        answer = h.get("/v1/batches")
    assert answer.status_code == 503
    assert answer.headers["Retry-After"] == "5"
    assert answer.json()["error"]["code"] == "store_unavailable"


def test_capacity_shows_each_node_and_the_queued_tokens(
    server: LiveServer, acme: Tenant, repo: Repository
) -> None:
    repo.nodes.upsert_node("gpu-0", "http://gpu-0:8000", "tiny-model", 1000, 16, 4000)
    submit(server.client(acme.key), chat_file(2))
    run_worker(repo, limit=1, leave_running=1)
    with http(server, acme.key) as h:
        view = h.get("/v1/capacity").json()
    assert view["queued_tokens"]["batch"] >= 64
    (node,) = view["nodes"]
    assert node["name"] == "gpu-0"
    assert node["capacity_tokens"] == 16_000
    assert node["interactive_reserve_tokens"] == 4000
    assert node["source"] == "postgres"
    assert node["batch_reserved_tokens"] == 0  # the fake worker ran on node-test
    assert node["slack_tokens"] == 12_000
    assert json.dumps(view)
