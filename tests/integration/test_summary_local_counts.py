"""A summary job's documents counted with the model's tokenizer file where the API can read
it (the folder the engine names as its model's ``root``), checked against the engine's own
counts: through the real API and Postgres, with a stand-in engine on HTTP whose ``/tokenize``
counts as the file does (or, for the second test, one token more).

Red before: every document whose bytes did not settle its count was a ``/tokenize`` round trip
to the engine's API server, the process that serves its interactive traffic.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from batch_api_support import LiveServer, Tenant
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from backfill.store import Repository
from tests.integration.test_summary_jobs_api import api_on
from tests.support_tokenizer import word_count, write_tokenizer

pytestmark = pytest.mark.usefixtures("summary_counts_checked")

MODEL = "files-model"
CONTEXT = 400


class CountingEngine:
    """``/v1/models`` naming ``root`` as the model's folder; ``/tokenize`` counting as the
    tokenizer file does, plus ``off_by``; how many prompts it counted."""

    def __init__(self, root: Path, off_by: int = 0) -> None:
        self.root, self.off_by, self.prompts = root, off_by, 0

    async def models(self, _: Request) -> JSONResponse:
        model = {"id": MODEL, "max_model_len": CONTEXT, "root": str(self.root)}
        return JSONResponse({"data": [model]})

    async def tokenize(self, request: Request) -> JSONResponse:
        body = await request.json()
        if "messages" in body:
            text = "".join(m["content"] for m in body["messages"]) + " <assistant>"
        else:
            self.prompts += 1
            text = body["prompt"]
        return JSONResponse({"count": word_count(text) + self.off_by, "max_model_len": CONTEXT})

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/tokenize", self.tokenize, methods=["POST"]),
            ]
        )


# Longer in bytes than a chunk's tokens, so each is counted (none settles by its bytes).
ROWS = [{"id": f"d{i}", "text": f"Document {i}. " + "word, " * (60 + i % 40)} for i in range(200)]


def _send_all(repo: Repository, server: LiveServer, acme: Tenant, engine: CountingEngine) -> str:
    with api_on(engine.app(), repo, server, acme, MODEL) as api:
        job = api.post("/summary_jobs", json={"model": MODEL, "max_summary_tokens": 48})
        assert job.status_code == 200, job.text
        job_id = str(job.json()["id"])
        body = "".join(json.dumps(r) + "\n" for r in ROWS).encode()
        added = api.post(f"/summary_jobs/{job_id}/documents", content=body)
        assert added.status_code == 200, added.text
        assert added.json()["received"] == len(ROWS)
    return job_id


def _chunk_counts(repo: Repository, job_id: str) -> list[int]:
    return [d.chunks for d in repo.summary_reports.document_page(job_id, -1, 1000)]


def test_documents_are_counted_by_the_models_tokenizer_file_after_it_agrees(
    repo: Repository, server: LiveServer, acme: Tenant, tmp_path: Path
) -> None:
    engine = CountingEngine(write_tokenizer(tmp_path / "model"))
    job_id = _send_all(repo, server, acme, engine)
    # The first counts checked with the engine, then one in 64: not one a document.
    assert 0 < engine.prompts <= 40
    assert len(_chunk_counts(repo, job_id)) == len(ROWS)


def test_a_tokenizer_file_that_disagrees_leaves_every_count_to_the_engine(
    repo: Repository, server: LiveServer, acme: Tenant, tmp_path: Path
) -> None:
    engine = CountingEngine(write_tokenizer(tmp_path / "model"), off_by=1)
    job_id = _send_all(repo, server, acme, engine)
    assert engine.prompts >= len(ROWS)  # every document, as before
    stored = repo.summary_reports.document_page(job_id, -1, 1000)
    assert [d.source_id for d in stored] == [r["id"] for r in ROWS]
