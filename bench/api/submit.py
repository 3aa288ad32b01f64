"""Accepting a batch through the API vs raw psycopg COPY of the same rows, same run.

Backfill's path is what a client waits for: upload a 50,000-line JSONL file of ~2 KB chat
requests (``POST /v1/files``), create the batch (``POST /v1/batches``), and poll until it is
``in_progress`` (every line parsed and checked, the items stored with one COPY). The server
is ``backfill api`` in its own process. The peer is the building block alone: psycopg 3
binary COPY of the same rows into a plain table (as ``bench.ingest``). Figure: raw seconds /
API seconds (upload + create until in_progress); the create stage alone is reported too.

``--batches K`` creates K batches of the uploaded file back to back (each answers
``validating``; the API's ingest process checks and stores them one after another) and times
the create stage until every one is ``in_progress``: an ingest queue's throughput rather than
one batch's latency; the raw COPY side then copies the K files' rows.

The client uploads the file as a file object, streamed from disk in pieces (as the openai
SDK does with an open file); ``--bytes-client`` sends it as one bytes value held in memory
(how this benchmark measured before: the client's copies of the body then share the two
cores with the server).
"""

from __future__ import annotations

import json
import secrets
import tempfile
import time
from pathlib import Path

from bench.api.server import api_client, bench_key, start_api, stop_api
from bench.common import Stopwatch, finish, parser, scratch_database, table
from bench.store.ingest import make_bodies, raw_copy

NAME = "submit"
GOAL = 0.5


def jsonl_file(bodies: list[str]) -> bytes:
    return "".join(
        f'{{"custom_id": "req-{i}", "method": "POST", "url": "/v1/chat/completions", '
        f'"body": {b}}}\n'
        for i, b in enumerate(bodies)
    ).encode()


def api_submit(
    url: str,
    content: bytes,
    lines: int,
    *,
    stream_from: Path | None = None,
    batches: int = 1,
) -> tuple[float, float]:
    """(upload seconds, create-until-in_progress seconds: of every one of ``batches``
    creates of the file)."""
    namespace = f"bfbench{secrets.token_hex(3)}"
    key = bench_key(url)
    port = 18_000 + secrets.randbelow(2000)
    process = start_api(
        url,
        namespace,
        port,
        {
            "BACKFILL_MAX_LINES_PER_BATCH": str(max(lines, 100_000)),
            "BACKFILL_MAX_DEFERRED_CREATES_PER_TENANT": str(max(4, batches)),
        },
    )
    try:
        with api_client(port, key, 600) as h:
            with Stopwatch() as up:
                if stream_from is None:
                    uploaded = h.post(
                        "/v1/files",
                        data={"purpose": "batch"},
                        files={"file": ("bench.jsonl", content, "application/jsonl")},
                    )
                else:
                    with stream_from.open("rb") as f:
                        uploaded = h.post(
                            "/v1/files",
                            data={"purpose": "batch"},
                            files={"file": ("bench.jsonl", f, "application/jsonl")},
                        )
            uploaded.raise_for_status()
            with Stopwatch() as create:
                created = [
                    h.post(
                        "/v1/batches",
                        json={
                            "input_file_id": uploaded.json()["id"],
                            "endpoint": "/v1/chat/completions",
                            "completion_window": "72h",
                        },
                    ).json()
                    for _ in range(batches)
                ]
                done = []
                for seen in created:
                    batch = seen
                    while batch.get("status") == "validating":
                        time.sleep(0.05)
                        batch = h.get(f"/v1/batches/{batch['id']}").json()
                    done.append(batch)
            for batch in done:
                if batch.get("status") != "in_progress":
                    raise RuntimeError(f"batch not accepted: {json.dumps(batch)[:500]}")
                assert batch["request_counts"]["total"] == lines
    finally:
        stop_api(process, namespace)
    return up.seconds, create.seconds


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument(
        "--bytes-client",
        action="store_true",
        help="upload the file as one bytes value (the old client), not streamed from disk",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=1,
        help="batches created of the uploaded file, back to back (the ingest queue's throughput)",
    )
    args = p.parse_args()
    n = 10_000 if args.quick else 50_000
    k = args.batches
    bodies = make_bodies(n)
    content = jsonl_file(bodies)
    mb = len(content) / 1e6
    rounds: list[tuple[str, float, float]] = []
    with tempfile.TemporaryDirectory() as spool:
        stream_from = None if args.bytes_client else Path(spool) / "bench.jsonl"
        if stream_from is not None:
            stream_from.write_bytes(content)
        # Alternate the order so neither side always gets the warmer cache.
        for r in range(1 if args.quick else 2):
            for side in ("raw", "api") if r % 2 == 0 else ("api", "raw"):
                with scratch_database("bfsubmit") as url:
                    if side == "raw":
                        rounds.append(("raw", raw_copy(url, bodies * k), 0.0))
                    else:
                        upload_s, create_s = api_submit(
                            url, content, n, stream_from=stream_from, batches=k
                        )
                        rounds.append(("api", upload_s, create_s))
    raw = min(s for side, s, _ in rounds if side == "raw")
    upload_s, create_s = min(((u, c) for side, u, c in rounds if side == "api"), key=sum)
    api = upload_s + create_s
    rows = [
        ("raw psycopg COPY (pglz, no indexes)", n * k, mb * k, raw, n * k / raw),
        ("API: POST /v1/files (upload, checks)", n, mb, upload_s, n / upload_s),
        (f"API: POST /v1/batches x{k} -> in_progress", n * k, mb * k, create_s, n * k / create_s),
        ("API: total", n * k, mb * k, api, n * k / api),
    ]
    print(table(["path", "lines", "MB", "seconds (best)", "lines/s"], rows))
    finish(
        NAME,
        "ratio",
        raw / api,
        ">=",
        GOAL,
        {
            "lines": n,
            "mb": mb,
            "batches": k,
            "quick": args.quick,
            "client": "bytes" if args.bytes_client else "file object (streamed)",
            "raw_s": raw,
            "upload_s": upload_s,
            "create_s": create_s,
            # The create stage alone (file already uploaded) against the same raw COPY.
            "create_ratio": raw / create_s,
            "rounds": rounds,
        },
    )


if __name__ == "__main__":
    main()
