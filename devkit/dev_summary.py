"""``backfill dev``'s job: the bundled documents summarised in one summarisation job
(``/v1/summary_jobs``), as a user's dataset is.

Every bundled document is one row, and one more is all of them together: longer than the demo
model's context, it is split into chunks by the engine's tokenizer and map-reduced by the
server (its row reports its chunks and the depth of its reduce). The job's sampling settings
go into every step's request, map and reduce.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from devkit.demo_job import TERMINAL

INSTRUCTION = (
    "Summarise the following document in two or three sentences of your own. Say what it "
    "is and what it says; do not copy its lines."
)
WHOLE_COLLECTION = "all-the-documents"
"""The row that holds every bundled document at once (longer than the model's context)."""
SUMMARY_JOBS = "/v1/summary_jobs"
ENGINE_WAIT_S = 120.0
"""How long the create waits for the worker to register the engine (a 503 until then)."""


def demo_documents(docs: Path) -> list[tuple[str, str]]:
    """``(id, text)`` of each ``.txt`` document in ``docs``, then the whole collection."""
    documents = [(path.stem, path.read_text().strip()) for path in sorted(docs.glob("*.txt"))]
    if not documents:
        raise SystemExit(f"no .txt documents in {docs}")
    whole = "\n\n".join(f"{name}\n\n{text}" for name, text in documents)
    return [*documents, (WHOLE_COLLECTION, whole)]


def document_lines(documents: list[tuple[str, str]]) -> bytes:
    """The documents request's body: one JSON line ``{"id", "text"}`` each."""
    lines = (json.dumps({"id": doc_id, "text": text}) for doc_id, text in documents)
    return ("\n".join(lines) + "\n").encode()


def submit(
    client: httpx.Client,
    model: str,
    documents: list[tuple[str, str]],
    max_tokens: int,
    sampling: dict[str, float | int],
) -> dict[str, object]:
    """Create the job (waiting for the engine to be registered), send its documents and
    start it; the started job."""
    body = {
        "model": model,
        "instruction": INSTRUCTION,
        "max_summary_tokens": max_tokens,
        "completion_window": "1h",
        "sampling": sampling,
    }
    deadline = time.monotonic() + ENGINE_WAIT_S
    while True:
        created = client.post(SUMMARY_JOBS, json=body)
        if created.status_code != 503 or time.monotonic() > deadline:
            break
        time.sleep(float(created.headers.get("Retry-After", "1")))
    _raise_for(created)
    job_id = created.json()["id"]
    _raise_for(client.post(f"{SUMMARY_JOBS}/{job_id}/documents", content=document_lines(documents)))
    started = client.post(f"{SUMMARY_JOBS}/{job_id}/start")
    _raise_for(started)
    job: dict[str, object] = started.json()
    return job


def _raise_for(response: httpx.Response) -> None:
    if response.is_error:
        raise SystemExit(
            f"{response.request.method} {response.request.url.path}: "
            f"{response.status_code} {response.text}"
        )


def watch(
    client: httpx.Client, console: Console, job_id: str, engine_exited: Callable[[], str | None]
) -> dict[str, object]:
    """Follow the job to its end, in steps (map and reduce) finished of those planned; an
    engine that died ends the demo at once, saying why (the worker would wait for it)."""
    with Progress(
        TextColumn("[bold]5/5[/] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed:.0f}/{task.total:.0f} steps"),
        TextColumn("{task.fields[extra]}"),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task(job_id, total=1, extra="")
        while True:
            job: dict[str, object] = client.get(f"{SUMMARY_JOBS}/{job_id}").json()
            steps = job.get("progress") or {}
            assert isinstance(steps, dict)
            documents = steps.get("documents") or {}
            progress.update(
                task,
                total=max(1, int(steps.get("steps_planned", 1))),
                completed=int(steps.get("steps_done", 0)),
                description=f"{job_id} {job['status']}",
                extra=f"{documents.get('succeeded', 0)} documents summarised",
            )
            if job["status"] in TERMINAL:
                return job
            why = engine_exited()
            if why is not None:
                raise SystemExit(why)
            time.sleep(0.5)


def report(
    client: httpx.Client,
    console: Console,
    job: dict[str, object],
    job_s: float,
    setup_s: float,
    kept: Path,
) -> int:
    """The job's end, a few summaries (the whole collection's with its chunks and reduce
    depth), and every row written to ``kept`` (nothing printed needs a server); how many
    documents were not summarised."""
    steps = job.get("progress") or {}
    batches = job.get("batches") or []
    assert isinstance(steps, dict)
    assert isinstance(batches, list)
    console.print(
        f"\nsummary job {job['id']} {job['status']} in {job_s:.0f} s from submission: "
        f"documents {steps.get('documents')}, {steps.get('steps_done')} steps (map and "
        f"reduce) in {len(batches)} batches, "
        f"{steps.get('completion_tokens')} output tokens"
        f"\n(setup before it: {setup_s:.0f} s: database, engine, API and worker)"
    )
    results = client.get(f"{SUMMARY_JOBS}/{job['id']}/results")
    _raise_for(results)
    kept.write_text(results.text, encoding="utf-8")
    rows = [json.loads(line) for line in results.text.splitlines() if line.strip()]
    shown = rows[:3] + [r for r in rows if r.get("id") == WHOLE_COLLECTION]
    for row in shown:
        what = row.get("summary") or f"(no summary: {row.get('error')})"
        split = (
            f" ({row['chunks']} chunks, reduced in {row['split_depth']} levels)"
            if row.get("chunks", 1) > 1
            else ""
        )
        console.print(f"\n[bold]{row.get('id')}[/]{split}\n  {str(what).strip()}")
    console.print(f"\nall {len(rows)} results: {kept}", soft_wrap=True)
    return sum(1 for r in rows if r.get("summary") is None)
