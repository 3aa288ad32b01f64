"""The retention purge's cost: a batch of many items past its retention purged while another
batch's items are claimed, against the same claims with no purge, in one run.

A scratch database holds one ended batch of ``--items`` items (with an attempt each, ~2 KB
bodies: the size of a summarisation request) and one batch in progress. Claims take 16 items
at a time and give them back, round after round, for a few seconds alone, then while
maintenance ticks purge the ended batch (``repo.retention.purge_ended_jobs`` paced as the settings
say: ``BACKFILL_RETENTION_TICK_BUDGET_S``, ``..._CHUNK_TARGET_S``, ``..._CHUNK_ROWS``; a tick
every ``--interval`` seconds, or straight after one that ran longer) until it is gone. Figure:
claim p99 during the purge over claim p99 alone; the purge's rows per second, its longest tick
and its longest transaction are reported too.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from backfill.config import get_settings
from backfill.maintenance import purge_pace
from backfill.states import JobState
from backfill.store import NewItem, Repository
from bench.common import finish, parser, percentile, scratch_database, table
from bench.store.ingest import make_bodies

NAME = "retention"
GOAL = 2.0
BATCH = 16


def fill(repo: Repository, items: int, *, ended: bool) -> str:
    tenant = repo.tenants.create_tenant(f"t-{time.monotonic_ns()}").id
    f = repo.files.create_file(tenant, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        tenant, f.id, "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=24)
    )
    bodies = make_bodies(min(items, 5000))
    for start in range(0, items, 50_000):
        repo.ingest.insert_items(
            job.id,
            [
                NewItem(i, f"r{i}", bodies[i % len(bodies)], 64)
                for i in range(start, min(items, start + 50_000))
            ],
        )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    if ended:
        with repo.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO attempts (item_id, attempt, node, started_at, ended_at, "
                    "outcome) SELECT id, 1, 'n', now(), now(), 'succeeded' FROM items "
                    "WHERE job_id = :j"
                ),
                {"j": job.id},
            )
            conn.execute(
                text("UPDATE items SET state = 'succeeded' WHERE job_id = :j"), {"j": job.id}
            )
            conn.execute(
                text(
                    "UPDATE jobs SET state = 'completed', completed_at = now() - "
                    "interval '40 days' WHERE id = :j"
                ),
                {"j": job.id},
            )
    return job.id


def claims(repo: Repository, seconds: float, stop: threading.Event | None = None) -> list[float]:
    """Claim-and-finish rounds for ``seconds`` (or until ``stop``): each claim's milliseconds."""
    took: list[float] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and not (stop is not None and stop.is_set()):
        started = time.perf_counter()
        claim = repo.claims.open_claim("bench-node", BATCH, 60.0)
        took.append((time.perf_counter() - started) * 1000)
        if not claim.items:
            break
        repo.claims.drop_claim(claim)  # given back: nothing was written
    return took


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--items", type=int, default=None, help="items of the ended batch")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between tick starts")
    args = p.parse_args()
    items = args.items or (200_000 if args.quick else 1_000_000)
    settings = get_settings()
    pace = purge_pace(settings)
    with scratch_database("bfbench_ret") as url:
        repo = Repository.connect(url, pool_size=4)
        try:
            old = fill(repo, items, ended=True)
            fill(repo, 2_000, ended=False)
            alone = claims(repo, 5.0)
            stop = threading.Event()
            ticks: list[tuple[float, int]] = []
            longest_tx: list[float] = []

            def purge() -> None:
                while not stop.is_set():
                    started = time.perf_counter()
                    report = repo.retention.purge_ended_jobs(settings.retention_s, pace)
                    ticks.append((time.perf_counter() - started, report.rows))
                    longest_tx.append(report.longest_s)
                    if report.jobs:
                        stop.set()
                        return
                    time.sleep(max(0.0, args.interval - (time.perf_counter() - started)))

            purger = threading.Thread(target=purge)
            began = time.perf_counter()
            purger.start()
            during = claims(repo, 3600.0, stop)
            purger.join()
            purge_s = time.perf_counter() - began
            with repo.engine.connect() as conn:
                left = conn.execute(
                    text("SELECT count(*) FROM items WHERE job_id = :j"), {"j": old}
                ).scalar_one()
        finally:
            repo.close()
    rows = sum(r for _, r in ticks)
    ratio = percentile(during, 99) / percentile(alone, 99)
    print(
        table(
            ["claims", "count", "p50 ms", "p99 ms"],
            [
                ("alone", len(alone), percentile(alone, 50), percentile(alone, 99)),
                ("during the purge", len(during), percentile(during, 50), percentile(during, 99)),
            ],
        )
    )
    print(
        f"purged {rows:,} rows of items and webhook events (and {items:,} attempts with them) "
        f"in {purge_s:.1f} s over {len(ticks)} ticks: {rows / purge_s:,.0f} rows/s; the "
        f"longest tick {max(t for t, _ in ticks):.2f} s, longest transaction "
        f"{max(longest_tx):.2f} s; items left {left}"
    )
    finish(
        NAME,
        "claim_p99_ratio",
        ratio,
        "<=",
        GOAL,
        {
            "items": items,
            "claim_alone_p99_ms": percentile(alone, 99),
            "claim_during_p99_ms": percentile(during, 99),
            "purge_s": purge_s,
            "ticks": len(ticks),
            "longest_tick_s": max(t for t, _ in ticks),
            "longest_transaction_s": max(longest_tx),
            "budget_s": pace.budget_s,
            "target_s": pace.target_s,
            "interval_s": args.interval,
            "rows": rows,
            "items_left": left,
        },
        holds=left == 0,
    )


if __name__ == "__main__":
    main()
