"""``backfill summarize SOURCE``: a summarisation job over a dataset, and its results as one.

SOURCE is a folder of ``.txt``/``.md``/``.html`` documents, or a JSONL, CSV or Parquet file
(``--text-column``, ``--id-column``). It is read a row at a time (``backfill.summarize``'s
readers) and sent to the API in pages, so a file larger than memory goes through; the API
splits what is too long for the model and the server map-reduces it. ``backfill results
JOB -o out.parquet`` (or ``.csv``, ``.jsonl``) writes the job's rows: the source ids with their
summaries, usage, split depth and errors.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Group, RenderableType
from rich.table import Table

from backfill.summarize.documents import Document, SourceInvalid, SourceRow
from backfill.summarize.folder import count_files, read_folder
from backfill.summarize.prompts import DEFAULT_INSTRUCTION
from backfill.summarize.tables import read_table, table_rows
from backfill.summarize.writer import ResultsWriter, UnknownFormat, row_from_record
from backfill_cli.api_client import DEFAULT_API_URL, ApiClient, ApiError
from backfill_cli.client_commands import (
    ApiOpt,
    IntervalOpt,
    KeyOpt,
    _ago_or_in,
    _client,
    _watch,
    err,
    one_line_errors,
    progress_head,
)

SUMMARY_JOB_PREFIX = "sumjob_"
PAGE_BYTES = 4 * 1024 * 1024
"""Documents sent per request, at most (a document longer than this goes alone)."""
FIRST_PAGE_BYTES = 128 * 1024
"""The first request's documents: the job starts once they are in (the engine counts each
page before it answers), and each page after is twice the one before, up to ``PAGE_BYTES``.
One 4 MiB first page kept the engine idle ~20 s on 2,000 documents."""
PIECE_BYTES = 64 * 1024
"""A page is sent as pieces of about this size (a longer line is a piece of its own): pieces
are alike and each is let go once sent, so the next page's reuse their memory."""


def is_summary_job(job_id: str) -> bool:
    return job_id.startswith(SUMMARY_JOB_PREFIX)


def source_rows(
    source: Path, text_column: str | None, id_column: str | None
) -> Iterator[SourceRow]:
    """The rows of a folder or a table file, read as they are needed."""
    try:
        if source.is_dir():
            return read_folder(source)
        if not text_column:
            raise SourceInvalid(f"{source} is a table: name its text column with --text-column")
        return read_table(source, text_column, id_column)
    except SourceInvalid as exc:
        raise ApiError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class DocumentPage:
    """One request's documents: JSON lines joined into pieces of about ``PIECE_BYTES``, sent
    one after the other, and their total size (the request's ``Content-Length``)."""

    pieces: list[bytes]
    size: int

    def drain(self) -> Iterator[bytes]:
        """The pieces in order, each let go once it is taken: a page being sent is not held
        whole while the next one is read."""
        self.pieces.reverse()
        while self.pieces:
            yield self.pieces.pop()


def document_pages(
    rows: Iterator[SourceRow],
    page_bytes: int = PAGE_BYTES,
    piece_bytes: int = PIECE_BYTES,
    first_page_bytes: int | None = None,
) -> Iterator[DocumentPage]:
    """JSON lines of documents (and of rows that cannot be summarised, with their error),
    cut into pages of about ``page_bytes`` (the first of about ``first_page_bytes``, each
    after twice the one before, up to ``page_bytes``).

    A page is never joined into one object. A 4 MiB ``bytes`` made and freed for every page,
    beside the page's lines and while the page before was still held, fragmented the C heap:
    its free space grew with the input (14 to 50 MiB from 100,000 to 380,000 documents, no
    Python object kept), and so did the client (~115 bytes a document at 1 GiB)."""
    pieces: list[bytes] = []
    lines: list[bytes] = []
    size = lines_size = 0
    limit = min(page_bytes, first_page_bytes or page_bytes)
    for row in rows:
        if isinstance(row, Document):
            record: dict[str, Any] = {"id": row.id, "text": row.text}
        else:
            record = {"id": row.id if row.id is not None else f"row {row.row}", "error": row.error}
        line = json.dumps(record, ensure_ascii=False).encode() + b"\n"
        if size and size + len(line) > limit:
            if lines:
                pieces.append(b"".join(lines))
            yield DocumentPage(pieces, size)
            pieces, lines, size, lines_size = [], [], 0, 0
            limit = min(page_bytes, limit * 2)
        lines.append(line)
        size += len(line)
        lines_size += len(line)
        if lines_size >= piece_bytes:
            pieces.append(b"".join(lines))
            lines, lines_size = [], 0
    if lines:
        pieces.append(b"".join(lines))
    if size:
        yield DocumentPage(pieces, size)


def render_summary_status(job: dict[str, Any], now: float | None = None) -> RenderableType:
    now = time.time() if now is None else now
    progress = job.get("progress") or {}
    documents = progress.get("documents") or {}
    done, planned = int(progress.get("steps_done", 0)), int(progress.get("steps_planned", 0))
    header, bar = progress_head(
        job, job.get("model"), done, planned, "steps (map and reduce) finished"
    )
    facts = Table.grid(padding=(0, 2))
    more = ", more being sent" if job.get("documents_open") else ""
    facts.add_row(
        "documents",
        ", ".join(f"{documents.get(s, 0)} {s}" for s in ("pending", "succeeded", "failed")) + more,
    )
    facts.add_row(
        "tokens",
        f"{progress.get('prompt_tokens', 0)} prompt, {progress.get('completion_tokens', 0)} output",
    )
    facts.add_row("batches", str(len(job.get("batches") or [])))
    facts.add_row("ETA", _ago_or_in(progress.get("eta"), now))
    facts.add_row("deadline", _ago_or_in(job.get("expires_at"), now))
    if job.get("error"):
        facts.add_row("error", str(job["error"]))
    return Group(header, bar, facts)


def watch_summary(client: ApiClient, job_id: str, interval: float) -> None:
    _watch(lambda: client.summary_job(job_id), render_summary_status, interval)


@one_line_errors
def summarize(
    source: Annotated[
        Path,
        typer.Argument(
            help="A folder of .txt/.md/.html documents, or a .jsonl, .csv or .parquet file.",
            show_default=False,
        ),
    ],
    model: Annotated[str, typer.Option(help="The model that summarises.", show_default=False)],
    text_column: Annotated[
        str | None, typer.Option(help="The column of a table that holds the text.")
    ] = None,
    id_column: Annotated[
        str | None,
        typer.Option(help="The column of a table with each row's id (default: its number)."),
    ] = None,
    instruction: Annotated[str, typer.Option(help="What to ask of each document.")] = (
        DEFAULT_INSTRUCTION
    ),
    max_summary_tokens: Annotated[int, typer.Option(min=1, help="Summary length cap.")] = 256,
    window: Annotated[str, typer.Option(help="Completion window, e.g. 30m, 2h, 24h.")] = "24h",
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Follow the job to its end.")
    ] = False,
    interval: IntervalOpt = 1.0,
    api: ApiOpt = DEFAULT_API_URL,
    key: KeyOpt = None,
) -> None:
    """Summarise every document of SOURCE in one job (long ones map-reduced); prints the
    job id on stdout."""
    rows = source_rows(source, text_column, id_column)
    with _client(api, key) as client:
        job = client.create_summary_job(model, instruction, max_summary_tokens, window)
        try:
            job, sent = send_documents(client, job["id"], rows, expected_rows(source))
            if not sent.received:
                raise ApiError(f"{source} holds no documents")
        except SourceInvalid as exc:
            client.cancel_summary_job(job["id"])
            raise ApiError(str(exc)) from None
        except (OSError, ApiError):
            client.cancel_summary_job(job["id"])
            raise
        err.print(
            f"summary job {job['id']}: {sent.received} documents ({sent.split} split, "
            f"{sent.failed} not readable), {job['status']}, window {window}",
            markup=False,
        )
        print(job["id"])
        if watch:
            watch_summary(client, job["id"], interval)


def expected_rows(source: Path) -> int | None:
    """Rows ``source`` will give, where that is known without reading it: a folder's files,
    a Parquet file's footer (JSONL and CSV say it only by being read)."""
    return count_files(source) if source.is_dir() else table_rows(source)


@dataclass(slots=True)
class Sent:
    received: int = 0
    split: int = 0
    failed: int = 0

    def add(self, answer: dict[str, Any]) -> None:
        self.received += int(answer["received"])
        self.split += int(answer["split"])
        self.failed += int(answer["failed"])


def send_documents(
    client: ApiClient, job_id: str, rows: Iterator[SourceRow], expected: int | None
) -> tuple[dict[str, Any], Sent]:
    """Send the rows page by page and start the job as soon as its first page is in: with
    more pages to come it starts open (the engine runs the first documents while the rest
    are counted and sent) and is closed after the last. Returns the job as started (or as
    closed; nothing when no row was sent) and what was sent."""
    sent = Sent()
    pages = document_pages(rows, first_page_bytes=FIRST_PAGE_BYTES)
    page = next(pages, None)
    job: dict[str, Any] | None = None
    while page is not None:
        sent.add(client.add_summary_documents(job_id, page.drain(), page.size))
        page = next(pages, None)
        if job is None and page is not None:
            job = client.start_summary_job(job_id, more_documents=True, expected_documents=expected)
    if job is None:
        return (client.start_summary_job(job_id) if sent.received else {}), sent
    return client.close_summary_job(job_id), sent


def write_summary_results(client: ApiClient, job_id: str, output: Path) -> int:
    """The job's rows into ``output`` (its format by its suffix); a file that exists is
    complete (written as ``.part`` and renamed)."""
    partial = output.with_name(output.name + ".part" + output.suffix)
    try:
        writer = ResultsWriter(partial)
    except UnknownFormat as exc:
        raise ApiError(str(exc).replace(str(partial), str(output))) from None
    with writer:
        for record in client.summary_results(job_id):
            writer.write(row_from_record(record))
    partial.replace(output)
    return writer.rows


def register(app: typer.Typer) -> None:
    app.command()(summarize)
