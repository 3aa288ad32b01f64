"""A fleet that serves two models: two real vLLM engines on this machine, each serving the
tiny model under its own name, a worker beside each, one API. One batch per model and a mixed
interactive stream: every result came from the engine serving the model its line named (each
engine's own count of finished requests says which ran where), and a batch naming a model
neither serves is refused while they are live.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backfill.config import Settings
from backfill.finalize import finalize_ready_jobs
from backfill.states import JobState
from backfill.store import Repository
from devkit import devengine
from tests.integration.batch_api_support import api_settings, chat_line, make_tenant, serve
from worker.node import NodeThread

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

MODELS = ("tiny-a", "tiny-b")
ITEMS = 6
INTERACTIVE = 4


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, str]]:
    servers = []
    try:
        for name in MODELS:
            servers.append(
                devengine.start_model(
                    "tiny",
                    served_model_name=name,
                    num_gpu_blocks_override=32,
                    max_model_len=512,
                    kv_cache_gib=1,
                )
            )
    except devengine.DevEngineError as exc:
        for server in servers:
            server.stop()
        pytest.fail(f"could not provision a vLLM engine: {exc}", pytrace=False)
    try:
        yield {name: server.url for name, server in zip(MODELS, servers, strict=True)}
    finally:
        for server in servers:
            server.stop()


def finished_requests(engine_url: str) -> float:
    body = httpx.get(f"{engine_url}/metrics", timeout=10).text
    return sum(
        s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "vllm:request_success_total"
    )


def wait(cond: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_each_line_runs_on_the_model_it_names(settings: Settings, engines: dict[str, str]) -> None:
    s = api_settings(settings, lease_ttl_s=6.0, heartbeat_interval_s=1.0, shutdown_grace_s=3.0)
    repo = Repository.connect(s.database_url, pool_size=4)
    nodes = [NodeThread(s, f"node-{name}", url) for name, url in engines.items()]
    for node in nodes:
        node.start()
    try:
        for node in nodes:
            assert node.started.wait(120), f"node did not start: {node.error}"
        before = {name: finished_requests(url) for name, url in engines.items()}
        with serve(s) as api:
            tenant = make_tenant(repo, "two-models")
            client = api.client(tenant.key)
            batches = {}
            for name in MODELS:
                lines = b"".join(
                    json.dumps(
                        chat_line(f"{name}-{i}", f"Say {i}.", model=name, max_tokens=8)
                    ).encode()
                    + b"\n"
                    for i in range(ITEMS)
                )
                upload = client.files.create(file=(f"{name}.jsonl", lines), purpose="batch")
                batches[name] = client.batches.create(
                    input_file_id=upload.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                ).id

            def ask(i: int) -> str:
                model = MODELS[i % 2]
                answer = client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": f"Hi {i}"}], max_tokens=4
                )
                return answer.model

            with ThreadPoolExecutor(4) as pool:
                answered = list(pool.map(ask, range(INTERACTIVE)))
            assert answered == [MODELS[i % 2] for i in range(INTERACTIVE)]

            def all_done() -> bool:
                finalize_ready_jobs(repo)
                return all(
                    repo.jobs.get_job(None, job).state is JobState.COMPLETED
                    for job in batches.values()
                )

            wait(all_done, 900, "both batches")
            for name, job in batches.items():
                done = client.batches.retrieve(job)
                assert done.request_counts is not None
                assert done.request_counts.completed == ITEMS
                lines = client.files.content(done.output_file_id or "").text.splitlines()
                models = {json.loads(line)["response"]["body"]["model"] for line in lines}
                assert models == {name}, name
            # Each engine finished exactly its own model's requests: the batch's lines and
            # the interactive requests that named it.
            for name, url in engines.items():
                ran = finished_requests(url) - before[name]
                assert ran == ITEMS + INTERACTIVE // 2, (name, ran)

            unserved = client.files.create(
                file=("x.jsonl", json.dumps(chat_line("x", model="tiny-c")).encode() + b"\n"),
                purpose="batch",
            )
            with pytest.raises(openai.NotFoundError) as caught:
                client.batches.create(
                    input_file_id=unserved.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
            assert "`tiny-a`, `tiny-b`" in caught.value.message
    finally:
        for node in nodes:
            node.stop()
        for node in nodes:
            node.join(30)
        repo.close()
    for node in nodes:
        assert node.error is None
