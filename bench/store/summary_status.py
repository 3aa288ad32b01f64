"""A summarisation job's status read: its counts as kept (``summary_counts``, migration 0023)
vs counted from its rows (the read before), same run, same job; and what keeping them costs
a page of documents.

A scratch database holds one job of ``--documents`` documents (715,827: the 1 GiB corpus of
``bench.summarize``'s memory run) with a map step each, written a page of 10,000 a statement
(so the triggers keep its counts as the API's pages would) and folded as a page is. Each read
is timed ``--reads`` times, alternating: ``SummaryReports.summary_counts`` (what the status
route and the dashboard call) against the same figures counted over the job's documents and
steps. Then pages of 2,000 prepared documents are stored through the store's own
``add_documents`` with the tables' triggers on and off in turn (``ALTER TABLE ... DISABLE
TRIGGER``, this scratch database only). Figure: the kept read's p50 in ms (goal <= 5 ms at
any size); the ratio to the counted read beside it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from sqlalchemy import text

from backfill.config import Settings
from backfill.store import Repository
from backfill.summarize import jobs
from backfill.summarize.job_plan import JobShape
from bench.common import finish, parser, scratch_database, table

NAME = "summary_status"
GOAL_MS = 5.0
PAGE = 10_000
WRITE_PAGE = 2_000
SHAPE = JobShape(
    context_tokens=2048, map_prompt_tokens=40, reduce_prompt_tokens=60, summary_tokens=128
)
COUNTED = (
    "SELECT (SELECT array_agg(x) FROM (SELECT state, count(*), sum(prompt_tokens), "
    "sum(completion_tokens), count(*) FILTER (WHERE chunks > 1), max(split_depth) "
    "FROM summary_documents WHERE job_id = :i GROUP BY state) x), "
    "(SELECT array_agg(y) FROM (SELECT state, count(*), "
    "count(*) FILTER (WHERE batch_no IS NULL) FROM summary_steps WHERE job_id = :i "
    "GROUP BY state) y)"
)
TABLES = ("summary_documents", "summary_steps")


def _job(repo: Repository, settings: Settings, tenant_name: str) -> str:
    tenant = repo.tenants.create_tenant(tenant_name)
    request = jobs.SummaryJobRequest("m", "Summarise.", SHAPE.summary_tokens, "24h")
    return jobs.create_job(repo, settings, tenant, request, SHAPE).id


def _fill(repo: Repository, job_id: str, documents: int) -> float:
    t0 = time.perf_counter()
    for first in range(0, documents, PAGE):
        last = min(documents, first + PAGE) - 1
        params = {"j": job_id, "a": first, "b": last}
        with repo.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO summary_documents (job_id, seq, prompt_tokens) "
                    "SELECT :j, g, 40 FROM generate_series(CAST(:a AS int), CAST(:b AS int)) g"
                ),
                params,
            )
            conn.execute(
                text(
                    "INSERT INTO summary_steps (job_id, seq, node, body, line_bytes) "
                    "SELECT :j, g, 0, 'x', 1 "
                    "FROM generate_series(CAST(:a AS int), CAST(:b AS int)) g"
                ),
                params,
            )
        repo.summary_reports.fold_counts(job_id)
    return time.perf_counter() - t0


def _reads(repo: Repository, job_id: str, reads: int) -> tuple[list[float], list[float]]:
    kept: list[float] = []
    counted: list[float] = []
    with repo.engine.connect() as conn:
        for _ in range(reads):
            t0 = time.perf_counter()
            repo.summary_reports.summary_counts(job_id)
            kept.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            conn.execute(text(COUNTED), {"i": job_id}).one()
            counted.append((time.perf_counter() - t0) * 1000)
    return kept, counted


def _writes(repo: Repository, settings: Settings, pages: int) -> dict[str, list[float]]:
    """ms per page of :data:`WRITE_PAGE` documents through ``add_documents``, triggers on and
    off in turn, into a job of its own."""
    job_id = _job(repo, settings, "writes")
    job = repo.summary_jobs.get_summary_job(None, job_id)
    docs = [
        jobs.prepare_document(job, f"d{i}", f"Document {i} reports on the weather.", _count)
        for i in range(WRITE_PAGE)
    ]
    seen: dict[str, list[float]] = {"kept": [], "not kept": []}
    for n in range(2 * pages):
        side = "kept" if n % 2 == 0 else "not kept"
        _triggers(repo, enabled=side == "kept")
        t0 = time.perf_counter()
        repo.summary_jobs.add_documents(job_id, docs)
        seen[side].append((time.perf_counter() - t0) * 1000)
    _triggers(repo, enabled=True)
    return seen


def _count(text_: str) -> int:
    return 1 + len(text_.split())


def _triggers(repo: Repository, *, enabled: bool) -> None:
    with repo.engine.begin() as conn:
        for table_ in TABLES:
            verb = "ENABLE" if enabled else "DISABLE"
            conn.execute(text(f"ALTER TABLE {table_} {verb} TRIGGER USER"))


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--documents", type=int, default=715_827)
    p.add_argument("--reads", type=int, default=20)
    p.add_argument("--pages", type=int, default=10, help="pages written on each side")
    args = p.parse_args()
    documents = 100_000 if args.quick else args.documents
    with scratch_database("bfsumstat") as url:
        settings = Settings(database_url=url)
        repo = Repository.connect(url)
        try:
            job_id = _job(repo, settings, "reads")
            fill_s = _fill(repo, job_id, documents)
            kept, counted = _reads(repo, job_id, 5 if args.quick else args.reads)
            writes = _writes(repo, settings, 3 if args.quick else args.pages)
        finally:
            repo.close()
    kept_p50, counted_p50 = statistics.median(kept), statistics.median(counted)
    write_p50 = {side: statistics.median(ms) for side, ms in writes.items()}
    rows: list[list[Any]] = [
        ["status read, counts kept", f"{kept_p50:.2f}", f"{max(kept):.2f}"],
        ["status read, counted from rows", f"{counted_p50:.1f}", f"{max(counted):.1f}"],
        [f"page of {WRITE_PAGE:,} documents, counts kept", f"{write_p50['kept']:.1f}", ""],
        [f"page of {WRITE_PAGE:,} documents, not kept", f"{write_p50['not kept']:.1f}", ""],
    ]
    print(f"one job of {documents:,} documents and steps (written in {fill_s:.1f} s)")
    print(table(["what", "p50 ms", "max ms"], rows))
    print(
        f"read: kept / counted {kept_p50 / counted_p50:.4f}; "
        f"a page's write: kept / not kept {write_p50['kept'] / write_p50['not kept']:.3f}"
    )
    finish(
        NAME,
        "kept_read_p50_ms",
        kept_p50,
        "<=",
        GOAL_MS,
        {
            "documents": documents,
            "kept_ms": kept,
            "counted_ms": counted,
            "writes_ms": writes,
            "read_ratio": kept_p50 / counted_p50,
            "write_ratio": write_p50["kept"] / write_p50["not kept"],
        },
    )


if __name__ == "__main__":
    main()
