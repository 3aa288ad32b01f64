"""What the end-to-end tests share: an engine of a module's own, waiting on a condition, the
engine's block size, a node worker beside an engine with the stores it reports to, and a
batch run to completion through the openai SDK."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch
from sqlalchemy import text

from backfill.config import Settings
from backfill.finalize import finalize_ready_jobs
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy
from backfill.states import JobState
from backfill.store import Repository
from devkit import devengine
from tests.integration.batch_api_support import api_settings, jsonl
from worker.node import NodeThread


def engine_server(
    model: str, what: str = "a vLLM engine", **flags: object
) -> Iterator[devengine.EngineServer]:
    """A vLLM server of ``model`` started with ``flags`` (``devengine.start_model``), for a
    module fixture to yield from; stopped after. If it cannot start, the test fails with the
    reason: a silent skip would let CI pass without ever talking to an engine."""
    try:
        server = devengine.start_model(model, **flags)
    except devengine.DevEngineError as exc:
        pytest.fail(f"could not provision {what}: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


def engine_url(model: str, what: str = "a vLLM engine", **flags: object) -> Iterator[str]:
    """The URL of an ``engine_server``."""
    for server in engine_server(model, what, **flags):
        yield server.url


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def engine_core(server_pid: int) -> int:
    """The engine core process under vLLM's API server (it runs the model's steps; the API
    server keeps answering while it is stopped)."""
    for child in _children(server_pid):
        with contextlib.suppress(OSError):
            if "EngineCore" in Path(f"/proc/{child}/comm").read_text() or "EngineCore" in (
                Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
            ):
                return child
    raise AssertionError(f"no engine core process under {server_pid}: {_children(server_pid)}")


@contextmanager
def engine_core_stopped(server_pid: int) -> Iterator[None]:
    """The engine core stopped (SIGSTOP) inside the block: no step runs, every stream stays
    open and sends nothing, the API server still answers (``/tokenize``, ``/metrics``)."""
    core = engine_core(server_pid)
    os.kill(core, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(core, signal.SIGCONT)


def wait(cond: Callable[[], bool], timeout: float, what: str, poll_s: float = 0.05) -> None:
    """Poll ``cond`` every ``poll_s`` until it holds; fail naming ``what`` after ``timeout``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def block_size(engine_url: str) -> int:
    """The KV block size the engine reports in its metrics."""
    metrics = httpx.get(f"{engine_url}/metrics", timeout=10).text
    line = next(x for x in metrics.splitlines() if x.startswith("vllm:cache_config_info{"))
    labels = dict(
        part.split("=", 1) for part in line[line.index("{") + 1 : line.index("}")].split(",")
    )
    return int(labels["block_size"].strip('"'))


def successes_per_item(repo: Repository, job_id: str) -> dict[int, int]:
    """How many succeeded attempts each item of the job has (exactly once means 1 each)."""
    with repo.engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT i.id, count(a.*) FILTER (WHERE a.outcome = 'succeeded') "
                "FROM items i LEFT JOIN attempts a ON a.item_id = i.id "
                "WHERE i.job_id = :j GROUP BY i.id"
            ),
            {"j": job_id},
        ).all()
    return {r[0]: r[1] for r in rows}


@dataclass(frozen=True)
class NodeBeside:
    repo: Repository
    ledger: Ledger
    node: NodeThread


@contextmanager
def node_beside(
    settings: Settings, node: str, engine_url: str, start_timeout_s: float = 120
) -> Iterator[NodeBeside]:
    """A repository and a ledger over ``settings``, and the node worker ``node`` beside the
    engine at ``engine_url``, started within ``start_timeout_s``. On leaving, the worker
    stops and the stores close; a worker that failed meanwhile fails the test."""
    repo = Repository.connect(settings.database_url, pool_size=4)
    ledger = Ledger.from_url(
        settings.redis_url, settings.redis_namespace, pool_policy(settings), lease_ttl_ms=6000
    )
    thread = NodeThread(settings, node, engine_url)
    thread.start()
    try:
        assert thread.started.wait(start_timeout_s), f"node did not start: {thread.error}"
        yield NodeBeside(repo, ledger, thread)
    finally:
        thread.stop()
        thread.join(30)
        ledger.close()
        repo.close()
    assert thread.error is None, f"the node failed: {thread.error!r}"


def node_settings(settings: Settings, **overrides: Any) -> Settings:
    """The API's settings for a stack with a node worker: 6 s leases (as ``node_beside``'s
    ledger holds them), a heartbeat a second, 3 s to stop; ``overrides`` on top."""
    return api_settings(
        settings, lease_ttl_s=6.0, heartbeat_interval_s=1.0, shutdown_grace_s=3.0, **overrides
    )


def run_batch(
    client: openai.OpenAI,
    repo: Repository,
    lines: list[dict[str, Any]],
    endpoint: str,
    poll_s: float = 0.05,
) -> Batch:
    """Upload ``lines``, create a batch of them for ``endpoint`` (accepted: in progress, for
    that endpoint), finalize until the job completes (600 s at most), and return the Batch
    as the API then reports it."""
    upload = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
    )
    assert batch.status == "in_progress", batch
    assert batch.endpoint == endpoint

    def done() -> bool:
        finalize_ready_jobs(repo)
        return repo.jobs.get_job(None, batch.id).state is JobState.COMPLETED

    wait(done, 600, f"the batch to complete: {repo.stats.counted_states(batch.id)}", poll_s=poll_s)
    return client.batches.retrieve(batch.id)


def chat_and_stream(client: openai.OpenAI, model: str, max_tokens: int) -> list[Any]:
    """One chat completion and one streamed (with its usage asked for), each checked as the
    openai SDK reads them (the stream carries text); returns the stream's chunks."""
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=max_tokens
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None
    assert 0 < chat.usage.completion_tokens <= max_tokens
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count to five."}],
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == max_tokens  # ignore_eos: every token
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return chunks
