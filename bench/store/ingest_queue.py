"""A queue of deferred creates through the ingest loop vs raw psycopg COPY of the same rows,
same run.

A scratch database holds ``--batches`` creates of one ``--lines``-line file of ~2 KB chat
requests, each deferred (answered ``validating``); the ingest loop (``ingester.run``, in this
process, at this process's priority: no API, no HTTP, no ``nice``) checks and stores them
until every one is ``in_progress``. The peer is psycopg 3 binary COPY of the same rows into a
plain table (as ``bench.ingest``). Figure: raw seconds / queue seconds. What it isolates is the
ingest loop's own throughput over several files: the API's path (``bench.submit --batches``)
adds the create requests and an ingest process at the lowest CPU priority, which on a shared
machine measures the machine.
"""

from __future__ import annotations

import threading
import time

from backfill import batches, ingester
from backfill.config import Settings
from backfill.states import JobState
from backfill.store import Repository
from bench.api.submit import jsonl_file
from bench.common import Stopwatch, finish, parser, scratch_database, table
from bench.store.ingest import make_bodies, raw_copy

NAME = "ingest_queue"
GOAL = 0.5
CHAT = "/v1/chat/completions"


def queue_seconds(url: str, content: bytes, lines: int, count: int) -> float:
    """Seconds from the ingest loop's start until each of ``count`` deferred creates of
    ``content`` is ``in_progress``."""
    settings = Settings(
        database_url=url,
        ingest_inline_bytes=0,
        max_deferred_creates_per_tenant=max(4, count),
        max_lines_per_batch=max(lines, 100_000),
    )
    repo = Repository.connect(url, pool_size=3)
    try:
        tenant = repo.tenants.create_tenant("bench")
        upload = batches.upload_file(
            repo, settings, tenant.id, filename="in.jsonl", purpose="batch", content=content
        )
        request = batches.BatchRequest(upload.id, CHAT, "72h")
        jobs = [batches.create_batch(repo, settings, tenant, request).id for _ in range(count)]
        stop = threading.Event()
        loop = threading.Thread(target=ingester.run, args=(repo, settings, stop))
        with Stopwatch() as watch:
            loop.start()
            while any(repo.jobs.get_job(None, j).state is JobState.VALIDATING for j in jobs):
                time.sleep(0.05)
        stop.set()
        loop.join()
        for job_id in jobs:
            job = repo.jobs.get_job(None, job_id)
            if job.state is not JobState.IN_PROGRESS or job.counts.total != lines:
                raise RuntimeError(f"batch not accepted: {job.state} {job.errors}")
    finally:
        repo.close()
    return watch.seconds


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--batches", type=int, default=6, help="deferred creates of the file")
    p.add_argument("--lines", type=int, default=None, help="lines of the file")
    args = p.parse_args()
    n = args.lines or (10_000 if args.quick else 50_000)
    k = args.batches
    bodies = make_bodies(n)
    content = jsonl_file(bodies)
    rounds: list[tuple[str, float]] = []
    for r in range(1 if args.quick else 2):
        for side in ("raw", "queue") if r % 2 == 0 else ("queue", "raw"):
            with scratch_database("bfqueue") as url:
                if side == "raw":
                    rounds.append(("raw", raw_copy(url, bodies * k)))
                else:
                    rounds.append(("queue", queue_seconds(url, content, n, k)))
    raw = min(s for side, s in rounds if side == "raw")
    queue = min(s for side, s in rounds if side == "queue")
    mb = len(content) * k / 1e6
    print(
        table(
            ["path", "lines", "MB", "seconds (best)", "lines/s"],
            [
                ("raw psycopg COPY (pglz, no indexes)", n * k, mb, raw, n * k / raw),
                (f"ingest loop: {k} deferred creates", n * k, mb, queue, n * k / queue),
            ],
        )
    )
    finish(
        NAME,
        "ratio",
        raw / queue,
        ">=",
        GOAL,
        {"lines": n, "batches": k, "quick": args.quick, "raw_s": raw, "queue_s": queue},
    )


if __name__ == "__main__":
    main()
