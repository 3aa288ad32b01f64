"""A live Batch API server for tests, tenants with keys, input files, and a fake worker.

The server is the real application under uvicorn on a free port, in a thread of the test
process, over the test's own database and Redis namespace; clients talk to it over HTTP (the
openai SDK, or httpx for routes the SDK does not know).
"""

from __future__ import annotations

import json
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI
from openai import OpenAI
from openai.types import Batch
from sqlalchemy import Row, text

from backfill.config import Settings
from backfill.states import ItemState
from backfill.store import Finish, Repository, Start
from backfill.store.bodies import ITEM_BODY
from devkit.harness import free_port
from queue_api.app import create_app

CHAT = "/v1/chat/completions"

T = TypeVar("T")


@dataclass
class LiveServer:
    base_url: str
    settings: Settings
    app: FastAPI | None = None
    """The app the server runs (in this process): its state, for a test to look into."""

    def client(self, key: str) -> OpenAI:
        # No retries: tests look at the first answer (429s, 5xx) themselves.
        return OpenAI(api_key=key, base_url=f"{self.base_url}/v1", max_retries=0, timeout=60)


@contextmanager
def serve(settings: Settings, *, repository: Repository | None = None) -> Iterator[LiveServer]:
    port = free_port()
    app = create_app(settings, repository=repository)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the API server did not start")
        time.sleep(0.01)
    # The key cache is cleared when its revocation listener subscribes (it may have missed an
    # announcement before): on a loaded machine that came after a test's first requests, and
    # a test counting key lookups saw two where the first was forgotten.
    if not app.state.revocations.subscribed.wait(20):
        raise RuntimeError("the API's key revocation listener did not subscribe in 20 s")
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", settings, app)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def api_settings(settings: Settings, **overrides: Any) -> Settings:
    """The test's settings, with rate limits (per tenant, per address) no ordinary test
    reaches."""
    values: dict[str, Any] = {
        "rate_limit_per_s": 10_000.0,
        "rate_limit_burst": 10_000,
        "anonymous_rate_limit_per_s": 10_000.0,
        "anonymous_rate_limit_burst": 10_000,
    }
    values.update(overrides)
    return settings.model_copy(update=values)


@dataclass
class Tenant:
    id: str
    key: str


def make_tenant(repo: Repository, name: str, quota: int | None = None) -> Tenant:
    record = repo.tenants.create_tenant(name, quota)
    return Tenant(record.id, repo.tenants.create_api_key(record.id))


def chat_line(
    custom_id: str,
    content: str = "Summarise the plot of Hamlet in one line.",
    *,
    max_tokens: int = 64,
    model: str = "tiny-model",
    url: str = CHAT,
    **body_extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
    }
    body.update(body_extra)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def jsonl(lines: Iterable[dict[str, Any] | str]) -> bytes:
    return "".join(
        (line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines
    ).encode()


def submit_file(client: OpenAI, content: bytes, endpoint: str = CHAT) -> Batch:
    """Upload ``content`` (JSONL) and create a batch of it for ``endpoint``, within 24 h: the
    Batch as created."""
    upload = client.files.create(file=("batch.jsonl", content), purpose="batch")
    return client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )


def submit_lines(client: OpenAI, lines: list[dict[str, Any]], endpoint: str) -> Batch:
    """Upload ``lines`` and create a batch of them for ``endpoint``: the Batch as created."""
    return submit_file(client, jsonl(lines), endpoint)


def stored_lines(repo: Repository, job_id: str) -> list[Row[Any]]:
    """The job's items as stored, in line order: (custom_id, max_output_tokens, body), the
    body as a claim reads it (its own copy, or its line's in the input file)."""
    with repo.engine.connect() as conn:
        return list(
            conn.execute(
                text(
                    f"SELECT custom_id, max_output_tokens, {ITEM_BODY} AS body FROM items i "
                    "WHERE job_id = :j ORDER BY line_no"
                ),
                {"j": job_id},
            ).all()
        )


def assert_refused_line_by_line(
    batch: Batch, repo: Repository, errors: list[tuple[int, str, str]]
) -> None:
    """The batch failed at create with exactly ``errors`` (line, code, param), in order, and
    not one of its items was stored."""
    assert batch.status == "failed"
    assert batch.errors is not None
    assert batch.errors.data is not None
    assert [(e.line, e.code, e.param) for e in batch.errors.data] == errors
    assert repo.stats.counted_states(batch.id) == {}, "items were stored"


def chat_file(n: int, **kwargs: Any) -> bytes:
    return jsonl(chat_line(f"req-{i}", **kwargs) for i in range(n))


def completion_body(text: str, *, prompt_tokens: int = 5, output_tokens: int = 3) -> str:
    return json.dumps(
        {
            "id": "chatcmpl-test",
            "object": "chat.completion",
            "model": "tiny-model",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": output_tokens,
                "total_tokens": prompt_tokens + output_tokens,
            },
        }
    )


def run_worker(
    repo: Repository,
    *,
    fail: Iterable[str] = (),
    limit: int = 1000,
    leave_running: int = 0,
    answer: str | None = None,
) -> dict[str, tuple[int, int, int]]:
    """Claim, start and finish queued items as a worker would (no engine, no ledger):
    custom ids in ``fail`` fail, the rest succeed; the last ``leave_running`` claimed items
    stay running. Returns custom_id -> (item id, attempt, fencing token) of those."""
    failing = set(fail)
    opened = repo.claims.open_claim("node-test", limit, 30.0)
    claimed = opened.items
    fences = {item.id: 1001 + index for index, item in enumerate(claimed)}
    starts = [
        Start(
            item.id, item.attempt, f"ls_{item.id}", fences[item.id], item.max_output_tokens + 16, 16
        )
        for item in claimed
    ]
    if opened.open:
        assert sorted(repo.claims.start_claim(opened, starts)) == sorted(fences)
    running: dict[str, tuple[int, int, int]] = {}
    finishes = []
    for index, item in enumerate(claimed):
        fence = fences[item.id]
        if index >= len(claimed) - leave_running:
            running[item.custom_id] = (item.id, item.attempt, fence)
            continue
        if item.custom_id in failing:
            finishes.append(
                Finish(
                    item.id,
                    item.attempt,
                    fence,
                    ItemState.FAILED,
                    error=json.dumps({"code": "engine_error", "message": "the engine said no"}),
                )
            )
        else:
            finishes.append(
                Finish(
                    item.id,
                    item.attempt,
                    fence,
                    ItemState.SUCCEEDED,
                    result=completion_body(answer or f"answer to {item.custom_id}"),
                    output_tokens=3,
                    prompt_tokens=16,
                )
            )
    repo.items.finish(finishes)
    return running


def result_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def peak_growth(action: Callable[[], T]) -> tuple[T, int]:
    """``action()``, and the most Python memory allocated above the start while it ran
    (every thread of the process: the in-process server's work included)."""
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        result = action()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        if started:
            tracemalloc.stop()
    return result, peak - base
