"""The claim's plan at a realistic backlog: it walks its claim index in deadline order and stops
after the items it takes, whatever the backlog.

Its running-job condition was once an ``EXISTS``, which the planner turned into a hash join
reading every claimable item and sorting them all to keep 64: at 100,000 waiting items a
claim took 473 ms (``bench.pg_scale``, docs/scaling.md). The plan is the planner's choice from
its estimates, so this pins its shape on a backlog large enough for that choice to flip (here
the plain EDF claim's: 20,000 rows read with the EXISTS; the fair-share claim's flipped at
100,000 waiting items, too many to build in a test).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import text

from backfill.states import JobState
from backfill.store import Repository
from tests.integration.claiming import claim

BACKLOG = 20_000
ENDED_JOBS = 3_000
TAKE = 64
CLAIM_INDEXES = {"ix_items_claim_edf", "ix_items_claim_tenant"}


def _nodes(node: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from _nodes(child)


def items_read(plan: Any) -> tuple[int, set[str]]:
    """Rows the plan's scans of ``items`` returned (over all their loops), and the indexes
    they used."""
    top = plan[0] if isinstance(plan, list) else plan
    # The scans that find claimable items (the update's lookups by primary key are the
    # claimed items themselves).
    scans = [
        n
        for n in _nodes(top["Plan"])
        if n.get("Relation Name") == "items" and n.get("Index Name") != "pk_items"
    ]
    rows = sum(int(n.get("Actual Rows", 0)) * int(n.get("Actual Loops", 1)) for n in scans)
    return rows, {str(n["Index Name"]) for n in scans if "Index Name" in n}


@pytest.fixture
def backlog(database_url: str) -> str:
    return _backlog(database_url, analyze=True)


@pytest.fixture
def unanalyzed_backlog(database_url: str) -> str:
    return _backlog(database_url, analyze=False)


def _backlog(database_url: str, *, analyze: bool) -> str:
    repo = Repository.connect(database_url)
    try:
        tenants = [repo.tenants.create_tenant(f"plan-{t}") for t in range(3)]
        for k, tenant in enumerate(tenants):
            f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
            job = repo.jobs.create_job(
                tenant.id, f.id, "/v1/chat/completions", "24h",
                datetime.now(UTC) + timedelta(hours=20 + k),
            )  # fmt: skip
            with repo.engine.begin() as conn:
                conn.execute(
                    text(
                        "INSERT INTO items (job_id, tenant_id, line_no, custom_id, body, "
                        "max_output_tokens, deadline) "
                        "SELECT :j, :t, g, 'r' || g, '{}', 16, "
                        "  now() + interval '20 hours' + g * interval '1 ms' "
                        "FROM generate_series(1, :n) g"
                    ),
                    {"j": job.id, "t": tenant.id, "n": BACKLOG // len(tenants)},
                )
            repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        # A fleet's history: many ended jobs beside the few running, which is what makes the
        # running-job condition look selective to the planner.
        with repo.engine.begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, tenant_id, input_file_id, endpoint, "
                    "completion_window, state, deadline) "
                    "SELECT 'batch_old' || g, :t, 'file_old', '/v1/chat/completions', '24h', "
                    "  'completed', now() - interval '1 day' FROM generate_series(1, :n) g"
                ),
                {"t": tenants[0].id, "n": ENDED_JOBS},
            )
        if analyze:
            with repo.engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").execute(
                    text("ANALYZE items; ANALYZE jobs")
                )
    finally:
        repo.close()
    return database_url


@pytest.mark.parametrize("fair_share", [True, False], ids=["fair share", "plain EDF"])
def test_a_claim_reads_about_the_items_it_takes_not_the_backlog(
    backlog: str, fair_share: bool
) -> None:
    repo = Repository.connect(backlog, fair_share=fair_share)
    try:
        plan = repo.claims.explain_claim("plan-node", TAKE)
        read, indexes = items_read(plan)
        # Fair share takes twice the slots over several tenants, and locks what it reads.
        assert read <= 4 * TAKE, f"the claim read {read} rows of a backlog of {BACKLOG}"
        assert indexes, "the claim used no index"
        assert indexes <= CLAIM_INDEXES, indexes
        # Nothing was claimed: the explain ran in a transaction rolled back.
        taken = claim(repo, "plan-node", TAKE, 60)
        assert len(taken) == TAKE
    finally:
        repo.close()


@pytest.mark.parametrize("fair_share", [True, False], ids=["fair share", "plain EDF"])
def test_a_claim_walks_its_index_on_statistics_taken_before_the_backlog(
    unanalyzed_backlog: str, fair_share: bool
) -> None:
    """The statistics predate the backlog (here: none yet, as after a large submission into a
    large table, long before autovacuum analyzes it): the planner expects few claimable items,
    and chose a bitmap scan that read all 20,000 of them and sorted them to keep 64."""
    repo = Repository.connect(unanalyzed_backlog, fair_share=fair_share)
    try:
        read, indexes = items_read(repo.claims.explain_claim("plan-node", TAKE))
        assert read <= 4 * TAKE, f"the claim read {read} rows of a backlog of {BACKLOG}"
        assert indexes <= CLAIM_INDEXES, indexes
    finally:
        repo.close()
