"""Item ingest through the repository vs raw psycopg COPY of the same rows, same run.

Rows are ~2 KB of JSON (a chat summarisation request). The peer is the building block
itself: psycopg 3 binary COPY into a plain table with Postgres defaults (pglz, no indexes).
Backfill's path is ``Repository.ingest.insert_items``: binary COPY into the real ``items`` table
(lz4 bodies, its claim and status indexes) plus the per-job counters, in one transaction.
"""

from __future__ import annotations

import json
import random
import string
from datetime import UTC, datetime, timedelta

import psycopg

from backfill.config import libpq_url
from backfill.store import NewItem, Repository
from bench.common import Stopwatch, finish, parser, scratch_database, table

NAME = "ingest"
GOAL = 0.5


def make_bodies(n: int, seed: int = 7) -> list[str]:
    """n distinct ~2 KB request bodies (prose-like text, so compression behaves as for real)."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(800)]
    bodies = []
    for i in range(n):
        text = " ".join(rng.choices(words, k=300))
        body = {
            "model": "smollm2",
            "max_tokens": 64,
            "messages": [
                {"role": "system", "content": "Summarise the document in two sentences."},
                {"role": "user", "content": f"Document {i}: {text}"},
            ],
        }
        bodies.append(json.dumps(body))
    return bodies


def raw_copy(url: str, bodies: list[str]) -> float:
    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute(
            "CREATE TABLE raw_items (job_id text, line_no int, custom_id text, body text, "
            "max_output_tokens int)"
        )
        conn.commit()
        with Stopwatch() as sw:
            with (
                conn.cursor() as cur,
                cur.copy(
                    "COPY raw_items (job_id, line_no, custom_id, body, max_output_tokens) "
                    "FROM STDIN (FORMAT BINARY)"
                ) as copy,
            ):
                copy.set_types(["text", "int4", "text", "text", "int4"])
                for i, b in enumerate(bodies):
                    copy.write_row(("batch_raw", i, f"req-{i}", b, 64))
            conn.commit()
    return sw.seconds


def repository_ingest(url: str, bodies: list[str]) -> float:
    repo = Repository.connect(url)
    try:
        tenant = repo.tenants.create_tenant("bench")
        f = repo.files.create_file(tenant.id, "batch", "in.jsonl", None, size_bytes=0)
        job = repo.jobs.create_job(
            tenant.id, f.id, "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(days=1)
        )
        with Stopwatch() as sw:
            n = repo.ingest.insert_items(
                job.id, (NewItem(i, f"req-{i}", b, 64) for i, b in enumerate(bodies))
            )
        assert n == len(bodies)
        assert repo.jobs.get_job(None, job.id).counts.total == n
    finally:
        repo.close()
    return sw.seconds


def main() -> None:
    args = parser(NAME, __doc__ or "").parse_args()
    n = 20_000 if args.quick else 100_000
    bodies = make_bodies(n)
    mb = sum(len(b) for b in bodies) / 1e6
    rounds = []
    # Alternate the order so neither side always gets the warmer cache.
    for r in range(1 if args.quick else 2):
        for side in ("raw", "repo") if r % 2 == 0 else ("repo", "raw"):
            with scratch_database("bfingest") as url:
                secs = raw_copy(url, bodies) if side == "raw" else repository_ingest(url, bodies)
            rounds.append((side, secs))
    raw = min(s for side, s in rounds if side == "raw")
    repo = min(s for side, s in rounds if side == "repo")
    rows = [
        ("raw psycopg COPY (pglz, no indexes)", n, mb, raw, n / raw),
        ("Backfill Repository.insert_items", n, mb, repo, n / repo),
    ]
    print(table(["path", "rows", "MB", "seconds (best)", "rows/s"], rows))
    ratio = raw / repo
    finish(
        NAME,
        "ratio",
        ratio,
        ">=",
        GOAL,
        {
            "rows": n,
            "mb": mb,
            "raw_rows_per_s": n / raw,
            "repo_rows_per_s": n / repo,
            "rounds": rounds,
        },
    )


if __name__ == "__main__":
    main()
