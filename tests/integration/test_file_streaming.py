"""Files stream through the API: an upload, a batch created from it, and its download each
cost the API memory bounded by ``file_chunk_bytes``, not by the file's size.

Measured with tracemalloc over the real path (HTTP into the in-process server, Postgres
behind it): the peak of Python allocations above the start, in every thread, while one call
runs. The client streams from and to disk, so what is measured is the server's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from batch_api_support import LiveServer, Tenant, api_settings, peak_growth, serve

from backfill.config import Settings

CHUNK = 256 * 1024
MAX_LINE = 64 * 1024
BOUND = 4 * 1024 * 1024 + 4 * CHUNK
"""What one call may grow the process by: the server's spool of an upload (1 MiB in memory,
the rest on disk), a few pieces of the file, buffers of the HTTP and COPY streams."""
FILE_BYTES = 32 * 1024 * 1024


@pytest.fixture
def server(settings: Settings) -> Iterator[LiveServer]:
    # Every create checked and stored in its request, whatever the file's size: what this
    # process holds while it does is measured (an ingest process runs the same code).
    limited = api_settings(
        settings, file_chunk_bytes=CHUNK, max_line_bytes=MAX_LINE, ingest_inline_bytes=1 << 40
    )
    with serve(limited) as live:
        yield live


def _big_input(path: Path) -> str:
    """A valid batch file of FILE_BYTES (lines of ~4 KB), written to disk; its SHA-256."""
    digest = hashlib.sha256()
    filler = "lorem ipsum dolor sit amet " * 150
    with path.open("wb") as out:
        written = i = 0
        while written < FILE_BYTES:
            line = {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": "tiny-model",
                    "messages": [{"role": "user", "content": f"{i} {filler}"}],
                    "max_tokens": 8,
                },
            }
            raw = json.dumps(line).encode() + b"\n"
            out.write(raw)
            digest.update(raw)
            written += len(raw)
            i += 1
    return digest.hexdigest()


def _upload(http: httpx.Client, path: Path) -> httpx.Response:
    with path.open("rb") as f:
        return http.post("/v1/files", files={"file": ("in.jsonl", f)}, data={"purpose": "batch"})


def test_upload_create_and_download_of_a_large_file_stay_within_a_few_pieces(
    server: LiveServer, acme: Tenant, tmp_path: Path
) -> None:
    # Was: the upload read whole (and check_upload split it into lines), create read the
    # stored file whole, and the download answered with all of its bytes at once.
    path = tmp_path / "big.jsonl"
    expected = _big_input(path)
    headers = {"Authorization": f"Bearer {acme.key}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=300) as http:
        uploaded, upload_peak = peak_growth(lambda: _upload(http, path))
        assert uploaded.status_code == 200, uploaded.text
        assert uploaded.json()["bytes"] == path.stat().st_size
        file_id = uploaded.json()["id"]

        created, create_peak = peak_growth(
            lambda: http.post(
                "/v1/batches",
                json={
                    "input_file_id": file_id,
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "7d",
                },
            )
        )
        assert created.status_code == 200, created.text
        batch = created.json()
        assert batch["status"] == "in_progress", batch
        lines = sum(1 for _ in path.open("rb"))
        assert batch["request_counts"]["total"] == lines

        def download() -> str:
            digest = hashlib.sha256()
            with http.stream("GET", f"/v1/files/{file_id}/content") as response:
                assert response.status_code == 200
                for piece in response.iter_bytes():
                    digest.update(piece)
            return digest.hexdigest()

        downloaded, download_peak = peak_growth(download)
    assert downloaded == expected
    print(
        f"\nfile {FILE_BYTES} bytes: peak growth upload {upload_peak}, create {create_peak}, "
        f"download {download_peak} (bound {BOUND})"
    )
    assert upload_peak < BOUND, upload_peak
    assert create_peak < BOUND, create_peak
    assert download_peak < BOUND, download_peak


def test_an_upload_of_millions_of_short_lines_is_refused_in_bounded_memory(
    server: LiveServer, acme: Tenant, tmp_path: Path
) -> None:
    # Was: +375 MB for a 20 MB file of short lines (a list of every line).
    path = tmp_path / "short.jsonl"
    path.write_bytes(b"x\n" * (10 * 1024 * 1024))
    headers = {"Authorization": f"Bearer {acme.key}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=300) as http:
        refused, peak = peak_growth(lambda: _upload(http, path))
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "too_many_lines"
    print(f"\n20 MiB of short lines: peak growth {peak} (bound {BOUND})")
    assert peak < BOUND, peak
