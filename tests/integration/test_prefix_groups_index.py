"""A batch's shared prefixes (the Batch object's ``backfill.prefixes``, on every retrieve and
list page) are read from an index of the job's grouped items, not from every item of the job:
a job of 100,000 items without groups cost each retrieve 21-36 ms (``bench.status``)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

from sqlalchemy import text

from backfill.store import NewItem, Repository
from backfill.store.prefixes import _GROUPS


def test_a_batchs_prefix_groups_read_none_of_its_items_without_a_prefix(
    repo: Repository,
) -> None:
    # Red before migration 0021: a bitmap heap scan of the job's items by (job_id, state),
    # every one read and dropped by the filter (Rows Removed by Filter: 2,000).
    tenant = repo.tenants.create_tenant("groups-index")
    f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        tenant.id, f.id, "/v1/completions", "24h", datetime.now(UTC) + timedelta(hours=24)
    )
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": 5})
    repo.ingest.insert_items(job.id, (NewItem(i, f"r{i}", body, 5) for i in range(2000)))
    with repo.engine.connect() as conn:
        conn.execute(text("ANALYZE items"))
        plan = "\n".join(
            str(row[0])
            for row in conn.execute(text("EXPLAIN (ANALYZE, BUFFERS) " + _GROUPS), {"j": job.id})
        )
    assert "ix_items_job_prefix" in plan, plan
    assert "Rows Removed by Filter" not in plan, plan
    assert repo.prefixes.prefix_groups(job.id) == []
