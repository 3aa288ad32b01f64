"""The finish and the heartbeat find their items by primary key, however much churn the
active-items indexes carry.

Every item that ran leaves an entry in the partial indexes of active items until vacuum
removes it. With the state checked as a plain ``i.state = 'running'``, the planner read those
indexes (a bitmap scan of every entry, dead ones included) and hash-joined them with the
batch: 9,600 entries read to finish 64 after 150 claims, twice the statement's server time
(``bench.claim``'s finish). This pins the plan after churn, with fresh statistics as
autovacuum's ANALYZE leaves them.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import text

from backfill.states import ItemState, JobState
from backfill.store import Finish, NewItem, Repository, Start
from backfill.store.claims import HEARTBEAT
from backfill.store.driver import array_literal
from backfill.store.items import FINISH
from tests.integration.test_claim_plan import _nodes

ITEMS = 4_000
BATCH = 64


def _churn(repo: Repository, rounds: int) -> list[Start]:
    """Claim, start and finish ``rounds`` batches; then start one more and return it."""
    fence = 0
    for k in range(rounds + 1):
        claim = repo.claims.open_claim("plan-node", BATCH, 60)
        starts = []
        for item in claim.items:
            fence += 1
            starts.append(Start(item.id, item.attempt, f"l{fence}", fence, 128, 20))
        repo.claims.start_claim(claim, starts)
        if k == rounds:
            return starts
        done = [
            Finish(
                s.item_id, s.attempt, s.fencing_token, ItemState.SUCCEEDED, "{}", output_tokens=1
            )
            for s in starts
        ]
        assert len(repo.items.finish(done)) == BATCH
    raise AssertionError("unreachable")


def test_a_finish_and_a_heartbeat_read_their_items_by_primary_key_after_churn(
    database_url: str,
) -> None:
    repo = Repository.connect(database_url)
    try:
        tenant = repo.tenants.create_tenant("plan-finish")
        f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
        job = repo.jobs.create_job(
            tenant.id, f.id, "/v1/chat/completions", "24h", datetime.now(UTC) + timedelta(hours=2)
        )
        repo.ingest.insert_items(
            job.id, (NewItem(i, f"r{i}", "{}", 16, 20, 128) for i in range(ITEMS))
        )
        repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        with repo.engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("ANALYZE items"))
        starts = sorted(_churn(repo, 40), key=lambda s: s.item_id)
        params: dict[str, Any] = {
            "ids": array_literal(s.item_id for s in starts),
            "att": array_literal(s.attempt for s in starts),
            "fen": array_literal(s.fencing_token for s in starts),
            "st": array_literal(ItemState.SUCCEEDED.value for _ in starts),
            "res": array_literal("{}" for _ in starts),
            "err": array_literal(None for _ in starts),
            "out": array_literal(1 for _ in starts),
            "pt": array_literal(None for _ in starts),
        }
        with repo.engine.connect() as conn:
            tx = conn.begin()
            beat = _explain(conn, HEARTBEAT, {"t": 60, "ids": params["ids"], "att": params["att"]})
            finish = _explain(conn, FINISH, params)
            tx.rollback()
    finally:
        repo.close()
    for name, plan in (("heartbeat", beat), ("finish", finish)):
        top = plan[0] if isinstance(plan, list) else plan
        scans = [
            n
            for n in _nodes(top["Plan"])
            if n.get("Relation Name") == "items" and "Scan" in str(n["Node Type"])
        ]
        read = sum(int(n.get("Actual Rows", 0)) * int(n.get("Actual Loops", 1)) for n in scans)
        assert {n.get("Index Name") for n in scans} == {"pk_items"}, (name, scans)
        assert read <= BATCH, f"the {name} of {BATCH} read {read} rows of items"
        assert top["Plan"]["Actual Rows"] == BATCH, name  # and it moved them all


def _explain(conn: Any, statement: str, params: dict[str, Any]) -> Any:
    return conn.execute(text("EXPLAIN (ANALYZE, FORMAT JSON) " + statement), params).scalar_one()
