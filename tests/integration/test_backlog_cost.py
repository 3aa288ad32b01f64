"""A create plans its deadline with the backlog ahead of it (issue 35): that figure is read from
the unfinished jobs' counters, so one tenant's queued items never make another tenant's create
scan them.

Before, the fair-share backlog summed every unfinished item of every tenant: with a million
queued items of one tenant, each create of any other tenant took 190 ms in that query alone.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event

from backfill.batch_ingest import Admission, judge_tokens
from backfill.config import Settings
from backfill.states import ItemState, JobState
from backfill.store import Finish, NewItem, Repository
from tests.integration.claiming import claim
from tests.integration.test_claim_plan import _nodes

# The slow truth: worst-case tokens still to spend on every unfinished item, per tenant.
COUNTED_BACKLOG_BY_TENANT = (
    "SELECT tenant_id, sum(coalesce(prompt_tokens, 0) + max_output_tokens - partial_tokens) "
    "FROM items WHERE state IN ('queued', 'deferred', 'preempted', 'reserved', 'running') "
    "GROUP BY tenant_id"
)


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    r = Repository.connect(database_url)
    yield r
    r.close()


def _job(repo: Repository, tenant_id: str, n: int, max_output: int) -> str:
    f = repo.files.create_file(tenant_id, "batch", "in.jsonl", b"{}")
    job = repo.jobs.create_job(
        tenant_id, f.id, "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(
        job.id, (NewItem(i, f"r{i}", '{"messages": []}', max_output, 16) for i in range(n))
    )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    return job.id


def _statements_of(repo: Repository, run: Any) -> list[tuple[str, Any]]:
    """The SQL statements (with their parameters) that ``run()`` sends."""
    sent: list[tuple[str, Any]] = []

    def record(_c: Any, _cur: Any, statement: str, params: Any, _ctx: Any, _many: Any) -> None:
        sent.append((statement, params))

    event.listen(repo.engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        event.remove(repo.engine, "before_cursor_execute", record)
    return sent


@pytest.mark.parametrize("fair_share", [True, False])
def test_a_creates_deadline_plan_scans_no_items(
    repo: Repository, settings: Settings, fair_share: bool
) -> None:
    busy = repo.tenants.create_tenant("busy")
    for _ in range(2):
        _job(repo, busy.id, 50, 128)
    quiet = dataclasses.replace(repo.tenants.create_tenant("quiet"), enqueued_token_quota=10**12)
    admission = Admission(
        forecast=1000,
        now=datetime.now(UTC),
        window_s=86_400,
        throughput_tps=1e6,
        completion_window="24h",
    )
    planned = settings.model_copy(update={"fair_share": fair_share})
    sent = _statements_of(repo, lambda: judge_tokens(repo, planned, quiet, 1000, admission))
    queries = [(s, p) for s, p in sent if re.match(r"\s*(SELECT|WITH)\b", s, re.IGNORECASE)]
    assert queries, sent
    with repo.engine.connect() as conn:
        for statement, params in queries:
            plan = conn.exec_driver_sql("EXPLAIN (FORMAT JSON) " + statement, params).scalar()
            read = {n.get("Relation Name") for n in _nodes(plan[0]["Plan"])}
            assert "items" not in read, statement


def test_the_backlog_is_the_unfinished_items_worst_case_tokens(repo: Repository) -> None:
    a, b, c = (repo.tenants.create_tenant(n) for n in ("a", "b", "c"))
    _job(repo, a.id, 10, 128)
    _job(repo, a.id, 6, 300)
    _job(repo, b.id, 5, 64)
    # A job still validating, with no items yet, adds nothing.
    f = repo.files.create_file(c.id, "batch", "in.jsonl", b"{}")
    repo.jobs.create_job(c.id, f.id, "/v1/chat/completions", "24h", datetime.now(UTC))
    # Some items held, some running, two of those finished (one failed).
    taken = claim(repo, "n1", 7, leases=[("l1", 1), ("l2", 2), ("l3", 3)], prompt_tokens=16)
    assert len(taken) == 7
    repo.items.finish(
        [
            Finish(taken[0].id, taken[0].attempt, 1, ItemState.SUCCEEDED, "{}", output_tokens=9),
            Finish(taken[1].id, taken[1].attempt, 2, ItemState.FAILED, error="boom"),
        ]
    )
    with repo.engine.connect() as conn:
        truth = {r[0]: int(r[1]) for r in conn.exec_driver_sql(COUNTED_BACKLOG_BY_TENANT)}
    assert set(truth) == {a.id, b.id}
    assert {t.tenant_id: t.tokens for t in repo.stats.backlog_by_tenant()} == truth
    assert repo.stats.backlog_tokens() == sum(truth.values())
