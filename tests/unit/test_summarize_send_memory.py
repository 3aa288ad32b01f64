"""``backfill summarize``'s send path holds no more than about one page at a time.

A 1 GiB input grew the client by ~115 bytes a document. tracemalloc found no Python object
kept per document but the id digests (:mod:`backfill.summarize.seen_ids`): the rest was the C
heap, fragmented by a page-sized ``bytes`` (4 MiB, the lines joined) made and freed for every
request beside the page's lines. Sent as pieces of ``PIECE_BYTES``, a page is never joined, so
what the send path holds at its peak stays near one page, and its memory is reused alike.

The API here is a peer on a real socket that reads each body into one fixed buffer, so that
what tracemalloc counts is the client's alone.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from backfill.summarize.documents import Document
from backfill_cli import summary_commands
from backfill_cli.summary_commands import PAGE_BYTES, document_pages, summarize

DOC_BYTES = 1400


class CountingApi:
    """Answers every request with one JSON object; a documents body's lines are counted as
    they are read into a fixed buffer (no allocation that grows with the body)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = 0
        self.bodies: list[int] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        buffer = bytearray(64 * 1024)
        view = memoryview(buffer)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, conn.makefile("rb") as reader:
                while self._answer(conn, reader, view):
                    pass

    def _answer(self, conn: socket.socket, reader: io.BufferedReader, view: memoryview) -> bool:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            byte = reader.read(1)
            if not byte:
                return False
            head += byte
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        left = int(headers.get("content-length", "0"))
        self.bodies.append(left)
        newlines = 0
        while left:
            n = reader.readinto(view[: min(left, len(view))])
            newlines += view[:n].tobytes().count(b"\n")
            left -= n
        first = self.received
        if lines[0].split()[1].endswith("/documents"):
            self.received += newlines
        body = json.dumps(
            {"id": "sumjob_t", "status": "queued", "first": first, "received": newlines,
             "failed": 0, "split": 0}
        ).encode()  # fmt: skip
        conn.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def counting_api() -> Iterator[CountingApi]:
    api = CountingApi()
    yield api
    api.close()


def _corpus(path: Path, rows: int) -> None:
    words = [f"w{i % 997}x{i % 13}" for i in range(DOC_BYTES // 8)]
    texts = [" ".join(words[i % 7 :] + words[: i % 7])[:DOC_BYTES] for i in range(rows)]
    pq.write_table(pa.table({"id": [f"doc-{i}" for i in range(rows)], "text": texts}), path)


def test_sending_holds_about_one_page_not_two(
    counting_api: CountingApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = 4 * PAGE_BYTES // DOC_BYTES
    source, warm = tmp_path / "docs.parquet", tmp_path / "warm.parquet"
    _corpus(source, rows)
    _corpus(warm, 10)
    api = f"http://127.0.0.1:{counting_api.port}"
    # Once on a small file first: what is imported or cached on first use is not counted.
    summarize(warm, model="m", text_column="text", id_column="id", api=api, key="k")
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        summarize(source, model="m", text_column="text", id_column="id", api=api, key="k")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert counting_api.received == rows + 10
    # Pages grow from FIRST_PAGE_BYTES to PAGE_BYTES: most of the input goes in whole pages.
    assert len([b for b in counting_api.bodies if b > PAGE_BYTES // 2]) >= 2
    # One page's lines, one Parquet batch as Python strings (~0.3 page), the id digests:
    # 1.6 pages measured. The page joined beside its lines, while the one before was still
    # held, made 4.5.
    held = (peak - start) / PAGE_BYTES
    assert held < 2, f"{held:.2f} pages held at the peak"
    assert "sumjob_t" in capsys.readouterr().out


def _documents(n: int) -> Iterator[Document]:
    for i in range(n):
        yield Document(f"doc-{i}", "x" * (100 + i % 300))


def test_pages_are_pieces_under_the_page_size_that_join_to_every_line() -> None:
    n = 5000
    pages = list(document_pages(_documents(n), page_bytes=64 * 1024, piece_bytes=8 * 1024))
    assert len(pages) > 5
    sent = b"".join(piece for page in pages for piece in page.pieces)
    assert [json.loads(line)["id"] for line in sent.splitlines()] == [f"doc-{i}" for i in range(n)]
    for page in pages:
        assert page.size == sum(len(p) for p in page.pieces) <= 64 * 1024
        assert all(len(p) < 8 * 1024 + 500 for p in page.pieces)


def test_a_line_longer_than_a_page_goes_alone() -> None:
    long = Document("long", "y" * 10_000)
    pages = list(document_pages(iter([Document("a", "b"), long, Document("c", "d")]), 4096, 1024))
    assert [len(b"".join(p.pieces).splitlines()) for p in pages] == [1, 1, 1]
    assert summary_commands.PIECE_BYTES < 128 * 1024


def test_pages_grow_from_the_first_to_the_most_a_request_takes() -> None:
    rows = iter([Document(f"d{i}", "x" * 90) for i in range(200)])
    sizes = [p.size for p in document_pages(rows, page_bytes=4000, first_page_bytes=500)]
    assert sizes[0] <= 500
    assert sizes[1] > sizes[0] * 1.5
    assert max(sizes) <= 4000
    assert sizes[-2] > 3000  # whole pages once grown
