"""``/v1/summary_jobs`` through the real API and Postgres: create (shaped by the engine's
context and template counts), send documents, start, watch, cancel, read results. The engine
is a stand-in on HTTP that answers what the API asks of it (``/v1/models`` and ``/tokenize``,
a word count); the batch items are run by the stand-in worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import uvicorn
from batch_api_support import LiveServer, Tenant, run_worker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from typer.testing import CliRunner

from backfill.config import Settings
from backfill.store import Repository
from backfill.summarize import driver
from backfill_cli import summary_commands
from backfill_cli.api_client import ApiClient
from backfill_cli.app import app
from devkit.harness import free_port

pytestmark = pytest.mark.usefixtures("summary_counts_checked")

MODEL = "tiny-model"
P = "/summary_jobs"
CONTEXT = 400
_TOKENS = re.compile(r"\w+|[^\w\s]|\s+")


def _count(text: str) -> int:
    return 1 + len(_TOKENS.findall(text))


async def _models(_: Request) -> JSONResponse:
    return JSONResponse({"data": [{"id": MODEL, "max_model_len": CONTEXT, "root": MODEL}]})


async def _tokenize(request: Request) -> JSONResponse:
    body = await request.json()
    if "messages" in body:
        text = "".join(m["content"] for m in body["messages"]) + " <assistant>"
    else:
        text = body["prompt"]
    return JSONResponse({"count": _count(text), "max_model_len": CONTEXT})


async def _refused(_: Request) -> JSONResponse:
    return JSONResponse({"error": "Unauthorized"}, status_code=401)


@pytest.fixture
def locked_engine_url() -> Iterator[str]:
    """An engine that refuses the API's key (it holds another)."""
    yield from _serve(Starlette(routes=[Route("/v1/models", _refused)]))


def _serve(app: Starlette) -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


@contextlib.contextmanager
def api_on(
    app: Starlette, repo: Repository, server: LiveServer, tenant: Tenant, model: str = MODEL
) -> Iterator[httpx.Client]:
    """A client of the API as ``tenant``, with a node serving ``model`` on an engine that is
    ``app`` on HTTP (for the block's length)."""
    served = _serve(app)
    url = next(served)
    try:
        repo.nodes.upsert_node(f"node-{model}", url, model, 1000, 16, 0)
        with httpx.Client(
            base_url=f"{server.base_url}/v1",
            headers={"Authorization": f"Bearer {tenant.key}"},
            timeout=60,
        ) as api:
            yield api
    finally:
        next(served, None)


@pytest.fixture
def api(repo: Repository, server: LiveServer, acme: Tenant) -> Iterator[httpx.Client]:
    engine = Starlette(
        routes=[Route("/v1/models", _models), Route("/tokenize", _tokenize, methods=["POST"])]
    )
    with api_on(engine, repo, server, acme) as client:
        yield client


@pytest.fixture
def settings_(settings: Settings) -> Settings:
    return settings.model_copy(update={"max_lines_per_batch": 4})


LONG = "\n\n".join(
    f"Paragraph {i} of the long report. " + "It has several words in each sentence. " * 6
    for i in range(30)
)


def _send(api: httpx.Client, job_id: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    answer = api.post(f"{P}/{job_id}/documents", content=body)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_a_job_through_the_api_map_reduces_and_reads_back_as_rows(
    api: httpx.Client, repo: Repository, settings_: Settings
) -> None:
    created = api.post(
        P, json={"model": MODEL, "max_summary_tokens": 48, "completion_window": "1h"}
    )
    assert created.status_code == 200, created.text
    job = created.json()
    assert job["status"] == "receiving"
    assert job["context_tokens"] == CONTEXT
    assert job["fan_in"] >= 2

    first = _send(api, job["id"], [{"id": "long", "text": LONG}, {"id": "a", "text": "Short."}])
    assert first == {
        "object": "summary_job.documents",
        "first": 0,
        "received": 2,
        "failed": 0,
        "split": 1,
    }
    second = _send(
        api, job["id"], [{"id": "b", "text": "Also short."}, {"id": "c", "error": "missing text"}]
    )
    assert (second["first"], second["failed"]) == (2, 1)

    started = api.post(f"{P}/{job['id']}/start").json()
    assert started["status"] == "in_progress"
    assert started["expires_at"] is not None
    for _ in range(40):
        driver.drive(repo, settings_)
        status = api.get(f"{P}/{job['id']}").json()
        if status["status"] != "in_progress":
            break
        run_worker(repo)
    assert status["status"] == "completed"
    assert len(status["batches"]) >= 2  # several batch files under the one job
    progress = status["progress"]
    assert progress["documents"] == {"pending": 0, "succeeded": 3, "failed": 1}
    assert progress["steps_done"] == progress["steps_planned"]

    lines = [json.loads(x) for x in api.get(f"{P}/{job['id']}/results").text.splitlines()]
    assert [row["id"] for row in lines] == ["long", "a", "b", "c"]
    assert lines[0]["chunks"] > 1
    assert lines[0]["split_depth"] >= 1
    assert lines[0]["summary"].startswith("answer to 0:")
    assert lines[1]["summary"] == "answer to 1:0"
    assert lines[3] == {
        "id": "c",
        "summary": None,
        "error": "missing text",
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "chunks": 1,
        "split_depth": 0,
    }


def test_the_list_shows_the_tenants_jobs_newest_first_with_their_split_documents(
    api: httpx.Client, server: LiveServer, other: Tenant
) -> None:
    older = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    _send(api, older["id"], [{"id": "a", "text": "Short."}])
    newer = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    _send(api, newer["id"], [{"id": "long", "text": LONG}, {"id": "a", "text": "Short."}])
    _send(api, newer["id"], [{"id": "long2", "text": LONG + LONG}])
    with httpx.Client(
        base_url=f"{server.base_url}/v1", headers={"Authorization": f"Bearer {other.key}"}
    ) as theirs:
        hidden = theirs.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()

    listed = api.get(P).json()
    assert listed["object"] == "list"
    assert [j["id"] for j in listed["data"]] == [newer["id"], older["id"]]
    assert hidden["id"] not in json.dumps(listed)
    progress = listed["data"][0]["progress"]
    assert progress["split_documents"] == 2
    assert progress["deepest_split"] >= 1
    assert progress["documents"]["pending"] == 3
    assert listed["data"][1]["progress"]["split_documents"] == 0
    assert api.get(P, params={"limit": 1}).json()["has_more"] is True
    assert api.get(f"{P}/{newer['id']}").json()["progress"]["split_documents"] == 2


def test_a_started_job_has_its_map_batch_at_once_not_at_the_next_tick(
    api: httpx.Client,
) -> None:
    job = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    _send(api, job["id"], [{"id": "long", "text": LONG}, {"id": "a", "text": "Short."}])
    started = api.post(f"{P}/{job['id']}/start").json()
    # No maintenance tick runs here: the start's own first round made the batch.
    assert started["status"] == "in_progress"
    assert len(started["batches"]) == 1


def test_cancel_mid_job_through_the_api(
    api: httpx.Client, repo: Repository, settings_: Settings
) -> None:
    job = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    _send(api, job["id"], [{"id": "long", "text": LONG}, {"id": "a", "text": "Short."}])
    api.post(f"{P}/{job['id']}/start")
    driver.drive(repo, settings_)
    run_worker(repo, limit=2)
    cancelling = api.post(f"{P}/{job['id']}/cancel").json()
    assert cancelling["status"] == "cancelling"
    driver.drive(repo, settings_)
    assert api.get(f"{P}/{job['id']}").json()["status"] == "cancelled"
    late = api.post(f"{P}/{job['id']}/documents", content=b'{"id": "x", "text": "late"}\n')
    assert late.status_code == 409


def test_odd_requests_get_clear_errors(api: httpx.Client) -> None:
    too_long = api.post(P, json={"model": MODEL, "max_summary_tokens": 300})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["param"] == "max_summary_tokens"
    unknown = api.post(P, json={"model": "no-such-model"})
    assert unknown.status_code == 404
    job = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    bad = api.post(f"{P}/{job['id']}/documents", content=b'{"id": "a", "text": "x"}\nnot json\n')
    assert bad.status_code == 400
    assert "line 2" in bad.json()["error"]["message"]
    assert api.get(f"{P}/sumjob_nope").status_code == 404
    hot = api.post(P, json={"model": MODEL, "sampling": {"temperature": 9}})
    assert hot.status_code == 400
    assert hot.json()["error"]["param"] == "sampling"
    assert "between 0 and 2" in hot.json()["error"]["message"]
    greedy = api.post(
        P, json={"model": MODEL, "max_summary_tokens": 48, "sampling": {"temperature": 0}}
    )
    assert greedy.status_code == 200, greedy.text
    assert greedy.json()["sampling"] == {"temperature": 0}


def _cli(server: LiveServer, key: str, *args: str) -> tuple[int, str, str]:
    env = {"BACKFILL_API_URL": server.base_url, "BACKFILL_API_KEY": key, "COLUMNS": "160"}
    result = CliRunner().invoke(app, list(args), env=env, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_the_cli_summarises_a_parquet_file_into_a_parquet_of_summaries(
    api: httpx.Client,
    repo: Repository,
    server: LiveServer,
    acme: Tenant,
    settings_: Settings,
    tmp_path: Path,
) -> None:
    source = tmp_path / "docs.parquet"
    pq.write_table(
        pa.table(
            {
                "doc": ["long", "a", "a", "b"],
                "body": [LONG, "Short one.", "A repeated id.", ""],
            }
        ),
        source,
    )
    code, stdout, stderr = _cli(
        server,
        acme.key,
        "summarize",
        str(source),
        "--model",
        MODEL,
        "--text-column",
        "body",
        "--id-column",
        "doc",
        "--max-summary-tokens",
        "48",
    )
    assert code == 0, stderr
    job_id = stdout.strip()
    assert job_id.startswith("sumjob_")
    assert "4 documents (1 split, 2 not readable)" in stderr
    for _ in range(40):
        driver.drive(repo, settings_)
        if repo.summary_jobs.get_summary_job(None, job_id).state.value != "in_progress":
            break
        run_worker(repo)
    code, stdout, stderr = _cli(server, acme.key, "status", job_id)
    assert code == 0, stderr
    assert "completed" in stdout

    output = tmp_path / "out.parquet"
    code, _, stderr = _cli(server, acme.key, "results", job_id, "-o", str(output))
    assert code == 0, stderr
    rows = pq.read_table(output).to_pylist()
    assert [r["id"] for r in rows] == ["long", "a", "a", "b"]
    assert rows[0]["summary"].startswith("answer to 0:")
    assert rows[0]["split_depth"] >= 1
    assert rows[1]["summary"] == "answer to 1:0"
    assert rows[2]["error"].startswith("duplicate id 'a'")
    assert rows[3]["error"] == "empty text"
    assert not list(tmp_path.glob("*.part*"))

    code, _, stderr = _cli(server, acme.key, "results", job_id, "-o", str(tmp_path / "o.xlsx"))
    assert code == 1
    assert "name a file ending in .parquet, .csv, .jsonl" in stderr


def test_the_cli_starts_the_job_after_its_first_page_and_closes_it_after_its_last(
    api: httpx.Client,
    repo: Repository,
    server: LiveServer,
    acme: Tenant,
    settings_: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Red before: every page was sent to a job still receiving, and the job started (and the
    # engine got its first step) only after the last one was counted.
    source = tmp_path / "docs"
    source.mkdir()
    for i in range(12):
        (source / f"d{i:02}.txt").write_text(f"Document {i}. " + "Some words of it. " * 8)
    monkeypatch.setattr(summary_commands, "FIRST_PAGE_BYTES", 400)
    seen: list[tuple[str, bool]] = []
    send = ApiClient.add_summary_documents

    def watched(self: ApiClient, job_id: str, pieces: Any, size: int) -> dict[str, Any]:
        job = self.summary_job(job_id)
        seen.append((job["status"], job["documents_open"]))
        return send(self, job_id, pieces, size)

    monkeypatch.setattr(ApiClient, "add_summary_documents", watched)
    code, stdout, stderr = _cli(
        server, acme.key, "summarize", str(source), "--model", MODEL, "--max-summary-tokens", "48"
    )
    assert code == 0, stderr
    assert "12 documents (0 split, 0 not readable), in_progress" in stderr
    assert seen[0] == ("receiving", False)
    assert len(seen) >= 3
    assert set(seen[1:]) == {("in_progress", True)}  # sent while the job ran
    job_id = stdout.strip()
    job = api.get(f"{P}/{job_id}").json()
    assert job["documents_open"] is False  # closed after its last page
    assert job["batches"]  # the first page's batch was made before the rest were sent
    for _ in range(40):
        driver.drive(repo, settings_)
        if repo.summary_jobs.get_summary_job(None, job_id).state.value != "in_progress":
            break
        run_worker(repo)
    lines = [json.loads(x) for x in api.get(f"{P}/{job_id}/results").text.splitlines()]
    assert [row["id"] for row in lines] == [f"d{i:02}.txt" for i in range(12)]
    assert all(row["summary"] for row in lines)
    assert api.get(f"{P}/{job_id}").json()["status"] == "completed"


def test_an_open_job_over_http_takes_pages_until_closed(api: httpx.Client) -> None:
    job = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    _send(api, job["id"], [{"id": "a", "text": "Short."}])
    lone = api.post(f"{P}/{job['id']}/start", json={"expected_documents": 3})
    assert lone.status_code == 400, lone.text
    assert lone.json()["error"]["param"] == "expected_documents"
    started = api.post(
        f"{P}/{job['id']}/start", json={"more_documents": True, "expected_documents": 3}
    ).json()
    assert (started["status"], started["documents_open"]) == ("in_progress", True)
    assert _send(api, job["id"], [{"id": "b", "text": "Also short."}])["first"] == 1
    closed = api.post(f"{P}/{job['id']}/close").json()
    assert closed["documents_open"] is False
    assert closed["progress"]["documents"]["pending"] == 2
    late = api.post(f"{P}/{job['id']}/documents", content=b'{"id": "c", "text": "late"}\n')
    assert late.status_code == 409
    assert "takes documents only while" in late.json()["error"]["message"]
    other = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    early = api.post(f"{P}/{other['id']}/close")
    assert early.status_code == 409
    assert "start it" in early.json()["error"]["message"]


def test_a_page_for_a_running_job_makes_its_batch_and_leaves_the_round_to_the_driver(
    api: httpx.Client, repo: Repository
) -> None:
    # Red before: the request ran a whole round, harvesting and deciding everything that had
    # ended meanwhile (on a 600,000-document job, minutes a request).
    job = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
    _send(api, job["id"], [{"id": "a", "text": "Short."}])
    api.post(f"{P}/{job['id']}/start", json={"more_documents": True})
    run_worker(repo)  # the first document's item ends; no round has harvested it
    _send(api, job["id"], [{"id": "b", "text": "Also short."}])
    status = api.get(f"{P}/{job['id']}").json()
    assert len(status["batches"]) == 2  # the page's own batch, made by its request
    assert status["progress"]["steps_done"] == 0  # nothing harvested by the request


def test_an_engine_that_refuses_the_key_is_named_not_called_an_unserved_model(
    repo: Repository, locked_engine_url: str, server: LiveServer, acme: Tenant
) -> None:
    # Registered for its model; its engine answers 401 (the API holds another key). A newcomer
    # read "The model is not served by any node" (404) and looked for the wrong fault.
    repo.nodes.upsert_node("node-locked", locked_engine_url, "locked-model", 1000, 16, 0)
    answer = httpx.post(
        f"{server.base_url}/v1{P}",
        json={"model": "locked-model"},
        headers={"Authorization": f"Bearer {acme.key}"},
        timeout=60,
    )
    assert answer.status_code == 503, answer.text
    message = answer.json()["error"]["message"]
    assert "locked-model" in message
    assert "401" in message, message
    assert answer.headers["Retry-After"]


class _Overlap:
    """A ``/tokenize`` that answers a prompt once another is in flight beside it (or after
    ``wait_s`` alone), and keeps the most it held at once."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s, self.in_flight, self.most = wait_s, 0, 0
        self._company: asyncio.Event | None = None

    async def handle(self, request: Request) -> JSONResponse:
        body = await request.json()
        if "messages" in body:  # the create's template counts: answered at once
            return await _tokenize_body(body)
        self._company = self._company or asyncio.Event()
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        if self.in_flight > 1:
            self._company.set()
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._company.wait(), self.wait_s)
        finally:
            self.in_flight -= 1
        return await _tokenize_body(body)


async def _tokenize_body(body: dict[str, Any]) -> JSONResponse:
    if "messages" in body:
        text = "".join(m["content"] for m in body["messages"]) + " <assistant>"
    else:
        text = body["prompt"]
    return JSONResponse({"count": _count(text), "max_model_len": CONTEXT})


def test_a_requests_documents_are_counted_by_the_engine_several_at_once(
    repo: Repository, server: LiveServer, acme: Tenant
) -> None:
    # Red before: one document at a time (the engine never held two counts at once), so a
    # job's first batch waited for every document's round trip to the engine in turn.
    overlap = _Overlap(wait_s=2.0)
    engine = Starlette(
        routes=[
            Route("/v1/models", _models),
            Route("/tokenize", overlap.handle, methods=["POST"]),
        ]
    )
    with api_on(engine, repo, server, acme) as api:
        job = api.post(P, json={"model": MODEL, "max_summary_tokens": 48}).json()
        # Each longer in bytes than a chunk's tokens: each counted by the engine once.
        rows = [{"id": f"d{i}", "text": f"Document {i}. " + "word " * 80} for i in range(12)]
        rows.insert(5, {"id": "unread", "error": "not UTF-8"})
        added = _send(api, job["id"], rows)
        assert (added["received"], added["failed"]) == (13, 1)
    assert overlap.most > 1
    # ... and stored in the request's order, whatever order the counts came back in.
    stored = repo.summary_reports.document_page(job["id"], -1, 100)
    assert [d.source_id for d in stored] == [r["id"] for r in rows]
    assert [d.seq for d in stored] == list(range(len(rows)))
