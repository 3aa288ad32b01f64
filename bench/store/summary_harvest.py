"""A summarisation job's harvest round on a large map batch: what ended since the last round
(a window, ``ix_items_job_finished``, migration 0025) vs everything that ended (the round
before), same run, same job.

A scratch database holds one job of ``--documents`` documents (50,000: one map batch, under
``BACKFILL_MAX_LINES_PER_BATCH``'s default of 100,000 lines), its batch made by the reduce
driver itself (``ingest_items``). Half the batch's items are ended a minute ago (as a map
wave's are), and a round harvests them. Then, ``--rounds`` times in turn on each side,
``--ends`` more items end (a succeeded body, as the worker writes) and the driver's harvest
runs: with a window (``harvest_read`` as the driver takes it) or with the full read (what
every round did).

Figure: the windowed round's p50 over the full round's, same run (goal <= 0.2 at 50,000
lines: the full round grows with the batch, the windowed one with what ended in its window,
which reaches back ``WINDOW_SLACK_S`` before the last round's read).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from sqlalchemy import text

from backfill.config import Settings
from backfill.store import Repository
from backfill.summarize import driver, jobs
from backfill.summarize.job_plan import JobShape
from bench.common import finish, parser, scratch_database, table

NAME = "summary_harvest"
GOAL = 0.2
PAGE = 5_000
SHAPE = JobShape(
    context_tokens=2048, map_prompt_tokens=40, reduce_prompt_tokens=60, summary_tokens=128
)
ANSWER = json.dumps(
    {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "A summary."}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 3},
    }
)
# Items of the job's batch end, ``:n`` of them, stamped ``:ago`` seconds back.
END_ITEMS = (
    "UPDATE items SET state = 'succeeded', result = :r, output_tokens = 3, "
    "finished_at = now() - make_interval(secs => :ago) WHERE id IN ("
    "  SELECT id FROM items WHERE job_id = :b AND state = 'queued' ORDER BY id LIMIT :n)"
)


def _count(text_: str) -> int:
    return 1 + len(text_.split())


def _job(repo: Repository, settings: Settings, documents: int) -> tuple[str, str, float]:
    """The job, its one map batch's id, and the seconds its documents and batch took."""
    t0 = time.perf_counter()
    tenant = repo.tenants.create_tenant("harvest")
    request = jobs.SummaryJobRequest("m", "Summarise.", SHAPE.summary_tokens, "24h")
    job = jobs.create_job(repo, settings, tenant, request, SHAPE)
    for first in range(0, documents, PAGE):
        docs = [
            jobs.prepare_document(job, f"d{i}", f"Document {i} reports on the weather.", _count)
            for i in range(first, min(documents, first + PAGE))
        ]
        jobs.add_documents(repo, settings, tenant, job, docs)
    jobs.start_job(repo, settings, tenant, repo.summary_jobs.get_summary_job(None, job.id))
    while len(repo.summary_batches.summary_batch_ids(job.id)) == 0:
        driver.drive(repo, settings)
    (batch_id,) = repo.summary_batches.summary_batch_ids(job.id)
    return job.id, batch_id, time.perf_counter() - t0


def _end(repo: Repository, batch_id: str, n: int, ago_s: float) -> None:
    with repo.engine.begin() as conn:
        conn.execute(text(END_ITEMS), {"r": ANSWER, "b": batch_id, "n": n, "ago": ago_s})


def _round(repo: Repository, job_id: str, *, full: bool) -> tuple[float, int]:
    """ms of one harvest, and the steps it ended."""
    if full:  # the round before: no window
        with repo.engine.begin() as conn:
            conn.execute(
                text("UPDATE summary_jobs SET harvest_full_at = NULL WHERE id = :i"),
                {"i": job_id},
            )
    job = repo.summary_jobs.get_summary_job(None, job_id)
    t0 = time.perf_counter()
    ended = driver.harvest(repo, job)
    return (time.perf_counter() - t0) * 1000, ended


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--documents", type=int, default=50_000)
    p.add_argument("--rounds", type=int, default=20, help="rounds on each side")
    p.add_argument("--ends", type=int, default=50, help="items ended before each round")
    args = p.parse_args()
    documents = 10_000 if args.quick else args.documents
    rounds = 6 if args.quick else args.rounds
    seen: dict[str, list[float]] = {"window": [], "full": []}
    with scratch_database("bfsumharvest") as url:
        settings = Settings(database_url=url)
        repo = Repository.connect(url)
        try:
            job_id, batch_id, made_s = _job(repo, settings, documents)
            _end(repo, batch_id, documents // 2, 60.0)
            _round(repo, job_id, full=True)  # the wave so far harvested
            with repo.engine.begin() as conn:
                conn.execute(text("ANALYZE"))  # as autovacuum will have, a wave in
            for n in range(2 * rounds):
                side = "window" if n % 2 == 0 else "full"
                _end(repo, batch_id, args.ends, 0.0)
                ms, ended = _round(repo, job_id, full=side == "full")
                if ended != args.ends:
                    raise SystemExit(f"a {side} round ended {ended} steps, not {args.ends}")
                seen[side].append(ms)
        finally:
            repo.close()
    p50 = {side: statistics.median(ms) for side, ms in seen.items()}
    rows: list[list[Any]] = [
        [f"{side} round", f"{p50[side]:.2f}", f"{max(ms):.2f}"] for side, ms in seen.items()
    ]
    print(
        f"one job of {documents:,} documents, its map batch made by the driver in "
        f"{made_s:.1f} s; half of it ended before, {args.ends} more before each round"
    )
    print(table(["harvest", "p50 ms", "max ms"], rows))
    finish(
        NAME,
        "window_over_full",
        p50["window"] / p50["full"],
        "<=",
        GOAL,
        {
            "documents": documents,
            "ends": args.ends,
            "window_ms": seen["window"],
            "full_ms": seen["full"],
            "ratio": p50["window"] / p50["full"],
        },
    )


if __name__ == "__main__":
    main()
