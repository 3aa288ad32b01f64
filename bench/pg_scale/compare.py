"""Postgres past one server: the fleet's tables at size, partitioning by deadline, and churn.

A. A scratch database at migration head holds a fleet's history and backlog (``--items``,
   default 10M: ~99% succeeded with a ~200 B result and one attempt each, ~1% queued in jobs
   in progress; a few thousand jobs over 20 tenants). Sizes of every table and index, the
   real ``Repository.claims.open_claim`` latency (fair share and plain EDF; each claim's items then
   held, written as a worker holds what it refuses), and ``EXPLAIN (ANALYZE, BUFFERS)`` of the
   claim's pick in a rolled-back transaction.
B. The peer: the same rows in ``items_p``, partitioned by RANGE (deadline) with the same
   indexes. The EDF claim core (``SELECT ... FOR UPDATE SKIP LOCKED`` + ``UPDATE``) on both
   tables, alternating: plans (partition pruning) and the latency ratio. Retention: one
   expired partition's worth of finished items by ``DELETE`` + ``VACUUM`` on ``items`` vs
   ``DETACH`` + ``DROP`` on ``items_p``.
C. Churn (``bench.pg_scale.churn``) on ``items`` for ``--churn-s``: the worker path against
   a constant backlog; dead tuples, autovacuum runs and claim p50/p99 every ``--window-s``.

Figure: claim p99 in the last churn window / the second (the first warms up) (goal <= 1.5):
whether the claim path stays flat while the table churns. A server with autovacuum off (the
development machine's) gets the vacuums it would run from ``--vacuum-at N``.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from backfill.config import libpq_url
from backfill.models import CLAIMABLE_SQL
from backfill.store import Repository
from bench.common import Stopwatch, finish, parser, percentile, scratch_database, table
from bench.pg_scale.churn import churn
from bench.pg_scale.load import Fleet, load, sizes
from bench.pg_scale.plan import (
    PlanSummary,
    copy_index,
    partition_bounds,
    partition_ddl,
    summarise_plan,
    summarise_windows,
)

NAME = "pg_scale"
GOAL = 1.5
MB = 1024 * 1024

# The EDF claim's core on either table: pick the earliest claimable, lock them, move them.
# ``{job}`` is the running-job check: as the repository writes it (EXISTS, which the planner
# may turn into a hash join that reads every claimable item and sorts them), or as a scalar
# subquery, a per-row filter that keeps the index's deadline order so LIMIT stops early.
_CORE = (
    "WITH picked AS (SELECT id, deadline FROM {t} WHERE state IN (" + CLAIMABLE_SQL + ") "
    "AND deadline > now() AND (not_before IS NULL OR not_before <= now()) AND {job} "
    "ORDER BY deadline, id LIMIT 64 FOR UPDATE SKIP LOCKED) "
    "UPDATE {t} i SET state = 'reserved', attempt = i.attempt + 1, node = %s, "
    "lease_expires_at = now() + interval '60 seconds', updated_at = now() "
    "FROM picked p WHERE i.id = p.id AND i.deadline = p.deadline RETURNING i.id"
)
_JOB_CHECKS = {
    "exists": (
        "EXISTS (SELECT 1 FROM jobs jb WHERE jb.id = {t}.job_id AND jb.state = 'in_progress')"
    ),
    "subquery": "(SELECT jb.state FROM jobs jb WHERE jb.id = {t}.job_id) = 'in_progress'",
}
_CORES = [(t, j) for j in _JOB_CHECKS for t in ("items", "items_p")]


def _core(t: str, job: str) -> str:
    return _CORE.format(t=t, job=_JOB_CHECKS[job].format(t=t))


def _explain(conn: psycopg.Connection[Any], sql: str, params: Any) -> PlanSummary:
    """EXPLAIN (ANALYZE, BUFFERS) of ``sql`` in a transaction that is rolled back."""
    with conn.transaction(force_rollback=True):
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
    assert row is not None
    plan = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return summarise_plan(plan)


def _explain_claim(url: str, fair: bool) -> PlanSummary:
    """The claim's pick, as ``Repository.claims.open_claim`` would send it."""
    repo = Repository.connect(url, pool_size=1, fair_share=fair)
    try:
        return summarise_plan(repo.claims.explain_claim("explain", 64))
    finally:
        repo.close()


def _claim_latency(url: str, fair: bool, n: int) -> tuple[float, float, int]:
    repo = Repository.connect(url, pool_size=1, fair_share=fair)
    ms: list[float] = []
    got = 0
    try:
        for i in range(n + 3):
            with Stopwatch() as sw:
                claim = repo.claims.open_claim(f"probe-{'fair' if fair else 'edf'}", 64, 60)
            if claim.open:
                # Held, so the next probe claims the next items (as the claim it replaced did).
                repo.claims.start_claim(claim, [], [(c.id, c.attempt) for c in claim.items])
            got += len(claim.items)
            if i >= 3:  # the first few warm the pool and the plan cache
                ms.append(sw.seconds * 1000)
    finally:
        repo.close()
    return percentile(ms, 50), percentile(ms, 99), got


def _print_plan(title: str, s: PlanSummary) -> None:
    shown = ", ".join(s.indexes[:4]) + (
        f" (+{len(s.indexes) - 4} more)" if len(s.indexes) > 4 else ""
    )
    print(
        f"\n{title}: execution {s.execution_ms:.2f} ms, planning {s.planning_ms:.2f} ms; "
        f"buffers hit {s.shared_hit:,} read {s.shared_read:,} dirtied {s.shared_dirtied:,}; "
        f"indexes {shown}"
        + (f"; partitions pruned {s.subplans_removed}" if s.subplans_removed else "")
    )
    for line in s.lines:
        print("    " + line)


def _sizes_table(conn: psycopg.Connection[Any], tables: list[str]) -> dict[str, Any]:
    rows, out = [], {}
    for t in tables:
        for r in sizes(conn, t):
            rows.append((t, r.name, r.kind, r.bytes / MB, r.rows if r.kind == "heap" else ""))
            out[f"{t}:{r.name}:{r.kind}"] = r.bytes
    print(table(["table", "relation", "kind", "MiB", "rows (est.)"], rows))
    return out


def _phase_a(url: str, libpq: str, args: Any, details: dict[str, Any]) -> Fleet:
    jobs = max(100, args.items // 3333)
    with Stopwatch() as sw:
        fleet = load(url, libpq, args.items, jobs, args.history_days)
    print(
        f"A. loaded {args.items:,} items ({fleet.backlog_items:,} queued) in {jobs:,} jobs, "
        f"{sw.seconds:.0f} s (indexes rebuilt, VACUUM ANALYZE)\n"
    )
    details["load_s"] = sw.seconds
    with psycopg.connect(libpq, autocommit=True) as conn:
        details["sizes"] = _sizes_table(conn, ["items", "attempts", "jobs", "job_counters"])
        per_item = sum(
            v for k, v in details["sizes"].items() if k.split(":")[0] in ("items", "attempts")
        )
        print(f"items + attempts: {per_item / args.items:,.0f} bytes per item")
        details["bytes_per_item"] = per_item / args.items
    for fair in (True, False):
        s = _explain_claim(url, fair)
        _print_plan(f"EXPLAIN claim ({'fair share' if fair else 'plain EDF'}), rolled back", s)
        details[f"plan_claim_{'fair' if fair else 'edf'}"] = s.lines
    rows = []
    for fair in (True, False):
        p50, p99, got = _claim_latency(url, fair, args.claims)
        rows.append(("fair share" if fair else "plain EDF", args.claims, got, p50, p99))
        details[f"claim_{'fair' if fair else 'edf'}_ms"] = (p50, p99)
    print()
    print(table(["Repository.claim (64)", "claims", "items", "p50 ms", "p99 ms"], rows))
    return fleet


def _phase_b(libpq: str, args: Any, details: dict[str, Any]) -> None:
    with psycopg.connect(libpq, autocommit=True) as conn:
        conn.execute("SET maintenance_work_mem = '512MB'")
        lo, hi = conn.execute("SELECT min(deadline), max(deadline) FROM items").fetchone() or (
            None,
            None,
        )
        assert lo is not None
        assert hi is not None
        bounds = partition_bounds(
            "items_p", lo.astimezone(UTC), hi.astimezone(UTC), timedelta(days=args.partition_days)
        )
        with Stopwatch() as sw:
            conn.execute(
                "CREATE TABLE items_p (LIKE items INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
                "INCLUDING STORAGE INCLUDING COMPRESSION) PARTITION BY RANGE (deadline)"
            )
            for stmt in partition_ddl("items_p", bounds):
                conn.execute(stmt)
            conn.execute("INSERT INTO items_p SELECT * FROM items")
            # A unique key must hold the partition key: (id) and (job_id, custom_id) can no
            # longer be enforced alone, nor can attempts reference items by id.
            conn.execute("ALTER TABLE items_p ADD PRIMARY KEY (id, deadline)")
            for (d,) in conn.execute(
                "SELECT indexdef FROM pg_indexes WHERE tablename = 'items' AND indexname NOT IN "
                "(SELECT conname FROM pg_constraint WHERE conrelid = 'items'::regclass)"
            ).fetchall():
                conn.execute(copy_index(d, "items", "items_p"))
            conn.execute("VACUUM (ANALYZE) items_p")
        print(
            f"\nB. items_p: {len(bounds)} partitions of {args.partition_days} day(s), "
            f"copied and indexed in {sw.seconds:.0f} s\n"
        )
        details["partitions"] = len(bounds)
        details["sizes_p"] = _sizes_table(conn, ["items_p"])
        plans = {(t, j): _explain(conn, _core(t, j), ("explain",)) for t, j in _CORES}
        for (t, j), s in plans.items():
            _print_plan(f"EXPLAIN EDF claim core on {t}, job check {j}, rolled back", s)
            details[f"plan_core_{t}_{j}"] = s.lines
        ms: dict[tuple[str, str], list[float]] = {c: [] for c in _CORES}
        for i in range(args.claims + 3):
            for t, j in _CORES if i % 2 == 0 else reversed(_CORES):
                with Stopwatch() as c:
                    conn.execute(_core(t, j), (f"core-{t}",)).fetchall()
                if i >= 3:
                    ms[(t, j)].append(c.seconds * 1000)
        rows = [(t, j, len(v), percentile(v, 50), percentile(v, 99)) for (t, j), v in ms.items()]
        print()
        print(
            table(
                ["EDF claim core (64), committed", "job check", "claims", "p50 ms", "p99 ms"], rows
            )
        )
        p50 = {c: percentile(v, 50) for c, v in ms.items()}
        for j in _JOB_CHECKS:
            print(
                f"partitioned / plain, p50, job check {j}: "
                f"{p50[('items_p', j)] / p50[('items', j)]:.2f}"
            )
        gain = p50[("items", "subquery")] / p50[("items", "exists")]
        print(f"subquery / exists on items, p50: {gain:.3f}")
        details["core_ms"] = {f"{t}:{j}": (r[3], r[4]) for (t, j), r in zip(ms, rows, strict=True)}
        _retention(conn, bounds[0].lo, bounds[0].hi, bounds[0].name, details)
        conn.execute("DROP TABLE items_p")


def _dead(conn: psycopg.Connection[Any], t: str) -> int:
    time.sleep(1.2)  # table stats reach the shared view within a second
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT n_dead_tup FROM pg_stat_user_tables WHERE relname = %s", (t,)
    ).fetchone()
    return int(row[0]) if row else -1


def _retention(
    conn: psycopg.Connection[Any], lo: datetime, hi: datetime, part: str, details: dict[str, Any]
) -> None:
    """One expired partition's worth of finished items: DELETE + VACUUM vs DETACH + DROP."""
    with Stopwatch() as d:
        # By job, as retention would (the jobs whose deadline fell in the partition's range).
        n = conn.execute(
            "DELETE FROM items WHERE job_id IN (SELECT id FROM jobs WHERE deadline >= %s "
            "AND deadline < %s)",
            (lo, hi),
        ).rowcount
    dead_items, dead_att = _dead(conn, "items"), _dead(conn, "attempts")
    with Stopwatch() as v:
        conn.execute("VACUUM items")
    with Stopwatch() as va:
        conn.execute("VACUUM attempts")
    with Stopwatch() as p:
        conn.execute(f"ALTER TABLE items_p DETACH PARTITION {part}")
        conn.execute(f"DROP TABLE {part}")
    rows = [
        ("DELETE (cascades to attempts)", n, d.seconds, f"{dead_items:,} + {dead_att:,} attempts"),
        ("VACUUM items (manual: unthrottled)", "", v.seconds, "heap + every index scanned"),
        ("VACUUM attempts", "", va.seconds, ""),
        ("DETACH + DROP PARTITION", n, p.seconds, "0"),
    ]
    print(f"\nretention: items with deadline in [{lo:%Y-%m-%d %H:%M}, {hi:%Y-%m-%d %H:%M})")
    print(table(["way", "items", "s", "dead tuples left"], rows))
    details["retention"] = {
        "items": n,
        "delete_s": d.seconds,
        "vacuum_items_s": v.seconds,
        "vacuum_attempts_s": va.seconds,
        "drop_partition_s": p.seconds,
        "dead_items": dead_items,
        "dead_attempts": dead_att,
    }


def _phase_c(url: str, libpq: str, fleet: Fleet, args: Any, details: dict[str, Any]) -> float:
    with psycopg.connect(libpq, autocommit=True) as conn:
        # What the probes claimed is put back: the churn starts from the loaded backlog.
        conn.execute(
            "UPDATE items SET state = 'queued', node = NULL, lease_expires_at = NULL "
            "WHERE state = 'reserved'"
        )
        conn.execute("VACUUM (ANALYZE) items")
        if args.autovacuum_scale is not None:
            f = float(args.autovacuum_scale)
            conn.execute(
                f"ALTER TABLE items SET (autovacuum_vacuum_scale_factor = {f}, "
                f"autovacuum_vacuum_insert_scale_factor = {f})"
            )
        settings: dict[str, str] = dict(
            conn.execute(
                "SELECT name, setting FROM pg_settings WHERE name IN ('autovacuum', "
                "'autovacuum_vacuum_scale_factor', 'autovacuum_vacuum_cost_delay', "
                "'autovacuum_vacuum_cost_limit', 'autovacuum_naptime', 'vacuum_cost_limit', "
                "'shared_buffers')"
            ).fetchall()
        )
    print(
        f"\nC. churn {args.churn_s:.0f} s, {args.claimers} claimers (claim 64 fair share -> "
        f"start_many -> finish) + a feeder; server: {settings}"
        + ("" if args.autovacuum_scale is None else f"; items scale factor {args.autovacuum_scale}")
    )
    claims, samples, done = churn(
        url,
        libpq,
        fleet,
        seconds=args.churn_s,
        claimers=args.claimers,
        window_s=args.window_s,
        next_custom=args.items + 1,
        vacuum_threshold=args.vacuum_at,
    )
    windows = summarise_windows(claims, args.window_s, args.churn_s)
    rows = []
    for w, s in zip(windows, samples[1:], strict=False):
        rows.append(
            (
                f"{w.start_s:.0f}-{w.start_s + args.window_s:.0f}",
                w.items / args.window_s,
                w.p50_ms,
                w.p99_ms,
                s.live,
                s.dead,
                s.vacuums,
                s.claim_index_bytes / MB,
                s.backlog,
                s.vacuum_phase,
            )
        )
    print(
        table(
            [
                "window s",
                "items/s",
                "claim p50",
                "claim p99",
                "live",
                "dead",
                "vacuums",
                "claim ix MiB",
                "backlog",
                "vacuum",
            ],
            rows,
        )
    )
    heap0, heap1 = samples[0].heap_bytes / MB, samples[-1].heap_bytes / MB
    wal = samples[-1].wal_lsn - samples[0].wal_lsn
    print(
        f"{done:,} items through in {args.churn_s:.0f} s ({done / args.churn_s:,.0f}/s); "
        f"heap {heap0:,.0f} -> {heap1:,.0f} MiB; WAL {wal / max(1, done):,.0f} bytes per item "
        "(the whole server's)"
    )
    details["churn"] = {
        "settings": settings,
        "done": done,
        "windows": [(w.start_s, w.claims, w.items, w.p50_ms, w.p99_ms) for w in windows],
        "samples": [
            (
                s.at_s,
                s.live,
                s.dead,
                s.vacuums,
                s.heap_bytes,
                s.claim_index_bytes,
                s.vacuum_phase,
                s.backlog,
            )
            for s in samples
        ],
    }
    full = [w for w in windows if w.claims]
    # The first window warms up (connections, statements not yet prepared): the second is
    # the baseline where there are three or more.
    return full[-1].p99_ms / full[1 if len(full) >= 3 else 0].p99_ms


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--items", type=int, default=None, help="items to load (10M; quick 1M)")
    p.add_argument("--churn-s", type=float, default=None, help="churn seconds (600; quick 30)")
    p.add_argument("--window-s", type=float, default=10.0, help="churn sample window")
    p.add_argument("--claimers", type=int, default=3, help="claimer processes in the churn")
    p.add_argument(
        "--claims", type=int, default=None, help="claims per latency probe (100; quick 30)"
    )
    p.add_argument("--history-days", type=float, default=28.0, help="span of finished deadlines")
    p.add_argument("--partition-days", type=int, default=1, help="items_p partition width")
    p.add_argument(
        "--autovacuum-scale",
        type=float,
        default=None,
        help="autovacuum scale factors set on items for the churn (default: the server's)",
    )
    p.add_argument(
        "--vacuum-at",
        type=int,
        default=None,
        help="VACUUM items (throttled as autovacuum) past this many dead tuples during the churn",
    )
    p.add_argument("--skip-partitioned", action="store_true", help="no phase B")
    args = p.parse_args()
    args.items = args.items or (1_000_000 if args.quick else 10_000_000)
    args.churn_s = args.churn_s or (30.0 if args.quick else 600.0)
    args.claims = args.claims or (30 if args.quick else 100)
    # Four probes claim from items (two in A, two in B) and none puts its items back: they
    # must leave the backlog (1% of the items) claimable, or the later probes time empty claims.
    cap = max(1, args.items // 100 // (4 * 64) - 3)
    if args.claims > cap:
        print(f"(--claims {args.claims} would drain the backlog: {cap} claims per probe)")
        args.claims = cap
    details: dict[str, Any] = {"args": vars(args), "started": datetime.now(UTC).isoformat()}
    with scratch_database("bfpgscale") as url:
        libpq = libpq_url(url)
        fleet = _phase_a(url, libpq, args, details)
        if not args.skip_partitioned:
            _phase_b(libpq, args, details)
        ratio = _phase_c(url, libpq, fleet, args, details)
    finish(NAME, "churn_p99_last/first", ratio, "<=", GOAL, details)


if __name__ == "__main__":
    main()
