"""``bench.summarize``'s corpus: the share of documents longer than the context, and a
Parquet file the CLI's reader takes row by row; the straight side's waves and downloads."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from backfill.summarize.documents import Document
from backfill.summarize.reduce_plan import plan_reduce
from backfill.summarize.tables import read_table
from bench.summarize import (
    BYTES_PER_TOKEN,
    document_lengths,
    download_file,
    levels,
    sentences,
    write_corpus,
)


def test_a_twentieth_of_the_documents_are_longer_than_the_context_the_rest_shorter() -> None:
    lengths = document_lengths(2000, 2048, 0.05, seed=1)
    context_bytes = 2048 * BYTES_PER_TOKEN
    assert len(lengths) == 2000
    assert sum(1 for x in lengths if x > context_bytes) == 100
    assert all(x >= 200 for x in lengths)
    assert document_lengths(2000, 2048, 0.05, seed=1) == lengths  # seeded
    assert sum(1 for x in document_lengths(10, 2048, 0.05, seed=1) if x > context_bytes) == 1


def test_the_corpus_is_a_parquet_of_ids_and_texts_of_the_drawn_lengths(tmp_path: Path) -> None:
    lengths = [300, 5000, 1200]
    path = tmp_path / "corpus.parquet"
    write_corpus(path, lengths, seed=3, rows_per_group=2)
    assert pq.read_metadata(path).num_rows == 3
    rows = list(read_table(path, "text", "id"))
    assert all(isinstance(r, Document) for r in rows)
    docs = [r for r in rows if isinstance(r, Document)]
    assert [d.id for d in docs] == ["doc-0", "doc-1", "doc-2"]
    longest = max(len(s) for s in sentences())
    for doc, size in zip(docs, lengths, strict=True):
        assert size <= len(doc.text) <= size + longest + 1


def test_the_straight_side_sends_maps_first_then_each_reduce_level_after_the_one_below() -> None:
    plan = plan_reduce(9, 3)  # 9 chunks: 3 reduces over them, 1 over those
    assert plan.depth == 2

    def line(seq: int, node: int) -> bytes:
        return json.dumps({"custom_id": f"{seq}:{node}"}).encode()

    lines = [line(0, n) for n in range(plan.nodes)] + [line(1, 0), line(2, 0)]
    waves = levels(lines, fan_in=3)
    ids = [[json.loads(x)["custom_id"] for x in wave] for wave in waves]
    assert ids[0] == [f"0:{n}" for n in range(9)] + ["1:0", "2:0"]
    assert ids[1] == ["0:9", "0:10", "0:11"]
    assert ids[2] == ["0:12"]


OUTPUT = b"".join(b'{"custom_id": "%d:0", "response": {}}\n' % i for i in range(5000))


class _Files(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path != "/v1/files/file-1/content":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(OUTPUT)))
        self.end_headers()
        self.wfile.write(OUTPUT)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def files_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_straight_side_saves_each_output_file_whole(files_server: str, tmp_path: Path) -> None:
    with httpx.Client(base_url=files_server) as client:
        lines, size = download_file(client, "file-1", tmp_path / "out.jsonl")
        assert (lines, size) == (5000, len(OUTPUT))
        assert (tmp_path / "out.jsonl").read_bytes() == OUTPUT
        with pytest.raises(httpx.HTTPStatusError):
            download_file(client, "file-2", tmp_path / "missing.jsonl")
