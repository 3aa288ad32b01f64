"""The fleet's history and backlog of ``bench.pg_scale``, bulk-loaded, and how big it is.

Tenants, files and jobs go through ``Repository``; items and attempts are made by SQL
(``INSERT ... SELECT generate_series``) with the tables' secondary indexes and foreign keys
dropped during the load and rebuilt after it, as a restore would, so 10M rows load in
minutes. ~99% of the items finished (succeeded, with a result) in jobs whose deadlines passed
over the last weeks; ~1% are queued in jobs in progress with deadlines in the next day.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from backfill.states import JobState
from backfill.store import Repository

TENANTS = 20
BODY = (
    '{"model": "m", "max_tokens": 256, "messages": [{"role": "user", "content": '
    '"Summarise the following support ticket in two sentences: customer reports that '
    "the export job stalls at 80% after the upgrade, #"
)
RESULT = (
    '{"id": "chatcmpl-x", "object": "chat.completion", "choices": [{"index": 0, '
    '"message": {"role": "assistant", "content": "The customer says exports stall at 80% '
    'since the upgrade; support asked for logs."}, "finish_reason": "stop"}], "usage": #'
)


@dataclass(frozen=True, slots=True)
class Fleet:
    """The jobs of a load: history (finished) and backlog (in progress)."""

    history_jobs: list[tuple[str, str, datetime]]
    backlog_jobs: list[tuple[str, str, datetime]]
    history_items: int
    backlog_items: int


def make_jobs(url: str, jobs: int, backlog_jobs: int, history_days: float) -> Fleet:
    """``jobs`` jobs over ``TENANTS`` tenants: the first ``jobs - backlog_jobs`` finished, their
    deadlines spread over the last ``history_days``; the rest in progress, due within a day."""
    now = datetime.now(UTC)
    repo = Repository.connect(url)
    try:
        tenants = []
        for t in range(TENANTS):
            tenant = repo.tenants.create_tenant(f"pgscale-{t}")
            f = repo.files.create_file(tenant.id, "batch", "in.jsonl", None, size_bytes=0)
            tenants.append((tenant.id, f.id))
        hist: list[tuple[str, str, datetime]] = []
        back: list[tuple[str, str, datetime]] = []
        n_hist = jobs - backlog_jobs
        for k in range(jobs):
            tenant_id, file_id = tenants[k % TENANTS]
            if k < n_hist:
                deadline = now - timedelta(days=history_days) * (1 - (k + 0.5) / n_hist)
                state = JobState.COMPLETED
            else:
                b = k - n_hist
                deadline = now + timedelta(hours=1 + 23 * b / max(1, backlog_jobs))
                state = JobState.IN_PROGRESS
            job = repo.jobs.create_job(tenant_id, file_id, "/v1/chat/completions", "24h", deadline)
            (hist if state is JobState.COMPLETED else back).append((job.id, tenant_id, deadline))
    finally:
        repo.close()
    return Fleet(hist, back, 0, 0)


def _secondary(conn: psycopg.Connection[Any], table: str) -> tuple[list[str], list[str]]:
    """The ``CREATE INDEX`` statements and ``ADD CONSTRAINT`` clauses (unique, foreign key)
    of ``table`` beyond its primary key."""
    cons = conn.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conrelid = %s::regclass AND contype IN ('u', 'f') ORDER BY conname",
        (table,),
    ).fetchall()
    idx = conn.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' "
        "AND tablename = %s AND indexname NOT IN (SELECT conname FROM pg_constraint "
        "WHERE conrelid = %s::regclass) ORDER BY indexname",
        (table, table),
    ).fetchall()
    for name, _ in cons:
        conn.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    for name, _ in idx:
        conn.execute(f"DROP INDEX {name}")
    return [d for _, d in idx], [f"ALTER TABLE {table} ADD CONSTRAINT {n} {d}" for n, d in cons]


def load(url: str, libpq: str, items: int, jobs: int, history_days: float) -> Fleet:
    """Load ``items`` items (and one attempt per finished item) into the scratch database."""
    backlog_jobs = max(TENANTS, jobs // 100)
    fleet = make_jobs(url, jobs, backlog_jobs, history_days)
    n_back = max(1, items // 100)
    n_hist = items - n_back
    hist_ids = [j[0] for j in fleet.history_jobs]
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute("SET maintenance_work_mem = '512MB'")
        conn.execute("SET synchronous_commit = off")
        conn.execute(
            "UPDATE jobs SET state = 'completed', in_progress_at = deadline - interval '1 day', "
            "completed_at = deadline - interval '1 hour' WHERE id = ANY(%s)",
            (hist_ids,),
        )
        conn.execute(
            "UPDATE jobs SET state = 'in_progress', in_progress_at = now() WHERE id = ANY(%s)",
            ([j[0] for j in fleet.backlog_jobs],),
        )
        restore: list[str] = []
        for table in ("attempts", "items"):
            indexes, constraints = _secondary(conn, table)
            restore += indexes + constraints
        # Finished items: job k holds a contiguous run of ids, as a fleet's history would.
        # A subscript into a text[] walks the array, so the jobs are joined from a table.
        conn.execute(
            "CREATE TEMP TABLE load_jobs AS SELECT k::int, job_id, tenant_id, d FROM "
            "unnest(%s::text[], %s::text[], %s::timestamptz[]) WITH ORDINALITY "
            "AS u(job_id, tenant_id, d, k)",
            (hist_ids, [j[1] for j in fleet.history_jobs], [j[2] for j in fleet.history_jobs]),
        )
        conn.execute("ANALYZE load_jobs")
        conn.execute(
            "INSERT INTO items (job_id, tenant_id, line_no, custom_id, body, prompt_tokens, "
            "max_output_tokens, reservation_tokens, state, deadline, attempt, fencing_token, "
            "node, lease_id, output_tokens, result, created_at, started_at, finished_at, "
            "updated_at) "
            "SELECT j.job_id, j.tenant_id, g, 'r' || g, %(body)s || g || '\"}]}', 60, 256, "
            "320, 'succeeded', j.d, 1, g, 'node-' || (g %% 1000), 'l' || g, 50, "
            "%(res)s || g || '}', j.d - interval '1 day', j.d - interval '2 hours', "
            "j.d - interval '1 hour', j.d - interval '1 hour' "
            "FROM generate_series(0, %(n)s - 1) g "
            "JOIN load_jobs j ON j.k = 1 + (g::bigint * %(nj)s / %(n)s)::int",
            {"nj": len(hist_ids), "n": n_hist, "body": BODY, "res": RESULT},
        )
        feed(conn, fleet, n_back, start=n_hist)
        conn.execute(
            "INSERT INTO attempts (item_id, attempt, node, lease_id, fencing_token, "
            "reserved_tokens, started_at, ended_at, outcome, prompt_tokens, output_tokens) "
            "SELECT id, 1, node, lease_id, fencing_token, 320, started_at, finished_at, "
            "'succeeded', 60, 50 FROM items WHERE state = 'succeeded'"
        )
        for stmt in restore:
            conn.execute(stmt)
        for table in ("items", "attempts", "jobs", "tenants"):
            conn.execute(f"VACUUM (ANALYZE) {table}")
    return Fleet(fleet.history_jobs, fleet.backlog_jobs, n_hist, n_back)


def feed(conn: psycopg.Connection[Any], fleet: Fleet, n: int, *, start: int) -> None:
    """Queue ``n`` new items round-robin over the backlog jobs (custom ids from ``start``)."""
    if n <= 0:
        return
    conn.execute(
        "INSERT INTO items (job_id, tenant_id, line_no, custom_id, body, prompt_tokens, "
        "max_output_tokens, reservation_tokens, state, deadline) "
        "SELECT (%(job)s::text[])[k], (%(ten)s::text[])[k], g, 'r' || g, "
        "%(body)s || g || '\"}]}', 60, 256, 320, 'queued', (%(dl)s::timestamptz[])[k] "
        "FROM (SELECT g, 1 + (g %% %(nj)s) AS k FROM generate_series(%(s)s, %(e)s) g) s",
        {
            "job": [j[0] for j in fleet.backlog_jobs],
            "ten": [j[1] for j in fleet.backlog_jobs],
            "dl": [j[2] for j in fleet.backlog_jobs],
            "nj": len(fleet.backlog_jobs),
            "s": start,
            "e": start + n - 1,
            "body": BODY,
        },
    )


@dataclass(frozen=True, slots=True)
class RelationSize:
    name: str
    kind: str  # heap | toast | index
    bytes: int
    rows: float


# The leaves of a partitioned relation, or the relation itself (pg_partition_tree gives no
# rows for a plain table or index).
_LEAVES = (
    "SELECT relid FROM pg_partition_tree(%(rel)s::regclass) WHERE isleaf "
    "UNION ALL SELECT %(rel)s::regclass WHERE NOT EXISTS "
    "(SELECT 1 FROM pg_partition_tree(%(rel)s::regclass))"
)


def sizes(conn: psycopg.Connection[Any], table: str) -> list[RelationSize]:
    """Heap, TOAST and each index of ``table``, summed over its partitions if it has any.
    Rows are the planner's estimate (``reltuples``, fresh after the load's ANALYZE)."""
    heap = conn.execute(
        "SELECT coalesce(sum(pg_relation_size(c.oid)), 0)::bigint, "
        "coalesce(sum(pg_total_relation_size(nullif(c.reltoastrelid, 0))), 0)::bigint, "
        "coalesce(sum(greatest(c.reltuples, 0)), 0)::float8 "
        f"FROM ({_LEAVES}) t JOIN pg_class c ON c.oid = t.relid",
        {"rel": table},
    ).fetchone()
    assert heap is not None
    out = [
        RelationSize(table, "heap", int(heap[0]), float(heap[2])),
        RelationSize(table, "toast", int(heap[1]), float("nan")),
    ]
    for name, size in conn.execute(
        "SELECT i.indexrelid::regclass::text, (SELECT coalesce(sum(pg_relation_size(t.relid)), "
        f"0)::bigint FROM ({_LEAVES.replace('%(rel)s::regclass', 'i.indexrelid')}) t) "
        "FROM pg_index i WHERE i.indrelid = %(rel)s::regclass ORDER BY 1",
        {"rel": table},
    ).fetchall():
        out.append(RelationSize(str(name), "index", int(size), float("nan")))
    return out
