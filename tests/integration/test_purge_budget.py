"""The retention purge's tick is bounded in time: once its budget is spent it starts no more
transactions and the next tick goes on where it stopped; a slow server shrinks its transactions,
tick after tick. Time here is a clock the test moves (each reading a step later), never the
wall clock."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import tick
from backfill.states import JobState
from backfill.store import NewItem, Repository
from tests.integration.support_sql import count_rows, kept_30_days


class SteppingClock:
    """A clock that moves ``step`` seconds at every reading: the purge reads it when its tick
    begins and before and after each transaction, so with a step of 0.5 s each transaction
    "takes" 0.5 s and a tick is 1 s in after its first."""

    def __init__(self, step: float) -> None:
        self.now = 1_000.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _batch(repo: Repository, tenant_id: str, items: int, *, ended: bool) -> str:
    """A batch of ``items`` items, each with an attempt; ended 40 days ago, or running (and
    created as long ago)."""
    f = repo.files.create_file(tenant_id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        tenant_id, f.id, "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=24)
    )
    repo.ingest.insert_items(
        job.id, [NewItem(i, f"r{i}", '{"messages":[]}', 8) for i in range(items)]
    )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO attempts (item_id, attempt, node, started_at, ended_at, outcome) "
                "SELECT id, 1, 'n', now(), now(), 'succeeded' FROM items WHERE job_id = :j"
            ),
            {"j": job.id},
        )
        ended_sql = (
            "UPDATE jobs SET state = 'completed', completed_at = now() - interval '40 days', "
            "created_at = now() - interval '41 days' WHERE id = :j"
            if ended
            else "UPDATE jobs SET created_at = now() - interval '41 days' WHERE id = :j"
        )
        if ended:
            conn.execute(
                text("UPDATE items SET state = 'succeeded' WHERE job_id = :j"), {"j": job.id}
            )
        conn.execute(text(ended_sql), {"j": job.id})
    return job.id


ITEMS = "SELECT count(*) FROM items WHERE job_id = :j"
ATTEMPTS = "SELECT count(*) FROM attempts a JOIN items i ON i.id = a.item_id WHERE i.job_id = :j"
JOB = "SELECT count(*) FROM jobs WHERE id = :j"
ITEM_STATES = "SELECT string_agg(state::text, ',' ORDER BY line_no) FROM items WHERE job_id = :j"


def test_a_tick_stops_once_its_budget_is_spent_and_later_ticks_finish_the_purge(
    settings: Settings, repo: Repository, tick_ledger: Ledger
) -> None:
    # Transactions of 50 rows, each "taking" 0.5 s: a 1 s budget holds one per tick.
    s = kept_30_days(
        settings,
        retention_chunk_rows=50,
        retention_chunk_target_s=2.0,
        retention_tick_budget_s=1.0,
        retention_rows_per_tick=100_000,
    )
    tenant = repo.tenants.create_tenant("acme").id
    old = _batch(repo, tenant, 300, ended=True)
    running = _batch(repo, tenant, 40, ended=False)
    with repo.engine.connect() as conn:
        states_before = conn.execute(text(ITEM_STATES), {"j": running}).scalar_one()
    clock = SteppingClock(0.5)

    first = tick(repo, tick_ledger, s, clock=clock).purged
    assert (first.rows, first.transactions, first.jobs) == (50, 1, 0)
    assert first.stopped == "budget"
    assert count_rows(repo, ITEMS, j=old) == 250  # left to the next tick
    # In line order: the next tick starts past the last line deleted.
    assert count_rows(repo, "SELECT min(line_no) FROM items WHERE job_id = :j", j=old) == 50
    assert count_rows(repo, JOB, j=old) == 1

    later = []
    while count_rows(repo, JOB, j=old) and len(later) < 30:
        later.append(tick(repo, tick_ledger, s, clock=clock).purged)
    # The other 250 rows one transaction a tick; 300 is a multiple of 50, so the last tick
    # finds no items left, then no events, and purges the job.
    assert [(r.rows, r.jobs) for r in later] == [(50, 0)] * 5 + [(0, 1)]
    for sql in (ITEMS, ATTEMPTS, JOB):
        assert count_rows(repo, sql, j=old) == 0
    assert tick(repo, tick_ledger, s, clock=clock).purged.stopped is None
    # The running batch, as old, is whole: its items, their states and attempts.
    assert count_rows(repo, ITEMS, j=running) == 40
    assert count_rows(repo, ATTEMPTS, j=running) == 40
    with repo.engine.connect() as conn:
        assert conn.execute(text(ITEM_STATES), {"j": running}).scalar_one() == states_before


def test_jobs_with_nothing_left_to_delete_still_go_a_budget_at_a_time(
    settings: Settings, repo: Repository, tick_ledger: Ledger
) -> None:
    # Batches that ended with no items (refused at validation, say) cost two empty looks and
    # their row each: a tick always purges one, and begins no other past its budget.
    s = kept_30_days(settings, retention_tick_budget_s=1.0)
    tenant = repo.tenants.create_tenant("acme").id
    empty = [_batch(repo, tenant, 0, ended=True) for _ in range(3)]
    clock = SteppingClock(0.5)
    done = [tick(repo, tick_ledger, s, clock=clock).purged for _ in range(3)]
    assert [(r.jobs, r.transactions, r.stopped) for r in done] == [
        (1, 2, "budget"),
        (1, 2, "budget"),
        (1, 2, None),
    ]
    assert count_rows(repo, "SELECT count(*) FROM jobs WHERE id = ANY(:e)", e=empty) == 0


def test_transactions_grow_while_fast_and_shrink_while_slow_tick_after_tick(
    settings: Settings, repo: Repository, tick_ledger: Ledger
) -> None:
    s = kept_30_days(
        settings,
        retention_chunk_rows=400,
        retention_chunk_target_s=0.2,
        retention_tick_budget_s=1.0,
        retention_rows_per_tick=700,
    )
    tenant = repo.tenants.create_tenant("acme").id
    old = _batch(repo, tenant, 2_000, ended=True)
    # Fast (a clock that stands still): from the smallest, doubled up to the configured size,
    # until the tick's rows are spent.
    still = SteppingClock(0.0)
    fast = tick(repo, tick_ledger, s, clock=still).purged
    assert (fast.rows, fast.transactions, fast.stopped) == (100 + 200 + 400, 3, "rows")
    # Slow (each transaction "takes" 0.5 s against a 0.2 s target): one a tick, each half the
    # one before, down to 100; each tick starts where the last one ended.
    slow = SteppingClock(0.5)
    done = [tick(repo, tick_ledger, s, clock=slow).purged.rows for _ in range(5)]
    assert done == [400, 200, 100, 100, 100]
    assert count_rows(repo, ITEMS, j=old) == 2_000 - 700 - 900
    # Fast again: 100, 200, then the last 100, and the job.
    last = tick(repo, tick_ledger, s, clock=still).purged
    assert (last.rows, last.jobs, last.stopped) == (400, 1, None)
    assert count_rows(repo, JOB, j=old) == 0
