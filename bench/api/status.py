"""Batch status reads (``GET /v1/batches/{id}``) with a million items in the database.

The batch being read holds every item (the worst case for a status read that counted rows);
items are bulk-loaded with COPY into the bench's own fresh database. The server is
``backfill api`` in its own process; one keep-alive client reads the batch sequentially, with
authentication and the rate limit on, as a polling client would. Figure: p99 latency in ms.
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from backfill.states import JobState
from backfill.store import NewItem, Repository
from bench.api.server import api_client, start_api, stop_api
from bench.common import Stopwatch, finish, parser, percentile, scratch_database, table

NAME = "status"
GOAL_MS = 20.0


def load(repo: Repository, tenant_id: str, n: int) -> str:
    upload = repo.files.create_file(tenant_id, "batch", "in.jsonl", b"{}\n")
    job = repo.jobs.create_job(
        tenant_id,
        upload.id,
        "/v1/chat/completions",
        "72h",
        datetime.now(UTC) + timedelta(hours=72),
        model="bench-model",
    )
    body = json.dumps({"model": "bench-model", "messages": [{"role": "user", "content": "hi"}]})
    repo.ingest.insert_items(job.id, (NewItem(i, f"req-{i}", body, 64) for i in range(1, n + 1)))
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    return job.id


def main() -> None:
    args = parser(NAME, __doc__ or "").parse_args()
    n_items = 100_000 if args.quick else 1_000_000
    reads = 500 if args.quick else 3000
    namespace = f"bfbench{secrets.token_hex(3)}"
    with scratch_database("bfstatus") as url:
        repo = Repository.connect(url)
        tenant = repo.tenants.create_tenant("bench")
        key = repo.tenants.create_api_key(tenant.id)
        with Stopwatch() as loading:
            job_id = load(repo, tenant.id, n_items)
        with repo.engine.begin() as conn:
            conn.execute(text("ANALYZE"))
        repo.close()

        port = 20_000 + secrets.randbelow(2000)
        process = start_api(url, namespace, port, {"BACKFILL_MAX_LINES_PER_BATCH": "100000"})
        latencies: list[float] = []
        try:
            with api_client(port, key, 30) as h:
                for _ in range(50):  # warm connections and caches
                    h.get(f"/v1/batches/{job_id}").raise_for_status()
                for _ in range(reads):
                    t0 = time.perf_counter()
                    answer = h.get(f"/v1/batches/{job_id}")
                    latencies.append((time.perf_counter() - t0) * 1000)
                    answer.raise_for_status()
                total = answer.json()["request_counts"]["total"]
                assert total == n_items, total
        finally:
            stop_api(process, namespace)

    p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
    rows: list[tuple[str, float | str]] = [
        ("items in the database", n_items),
        ("bulk load (s)", loading.seconds),
        ("reads", reads),
        ("p50 (ms)", p50),
        ("p99 (ms)", p99),
        ("max (ms)", max(latencies)),
    ]
    if args.quick:
        rows.insert(0, ("quick run: fewer items than the goal's 1,000,000", ""))
    print(table(["measure", "value"], rows))
    finish(
        NAME,
        "p99_ms",
        p99,
        "<=",
        GOAL_MS,
        {
            "items": n_items,
            "quick": args.quick,
            "reads": reads,
            "p50_ms": p50,
            "p99_ms": p99,
            "load_s": loading.seconds,
        },
    )


if __name__ == "__main__":
    main()
