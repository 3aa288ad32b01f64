"""Per-job counters equal COUNT(*) by state after any sequence of transitions (Hypothesis)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import text

from backfill.errors import StaleWrite
from backfill.states import ItemState, JobState
from backfill.store import ClaimedItem, Finish, NewItem, Repository, Start
from tests.integration.claiming import claim

OPS = st.sampled_from(
    [
        "claim",
        "start",
        "finish_ok",
        "finish_err",
        "preempt",
        "defer",
        "release",
        "fail_reserved",
        "reap",
        "cancel_unstarted",
        "heartbeat",
        "stale_finish",
        "drop",
    ]
)


@pytest.fixture(scope="module")
def module_repo(module_database_url: str) -> Iterator[Repository]:
    # One database for all examples; each example empties it first.
    repo = Repository.connect(module_database_url)
    yield repo
    repo.close()


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=st.lists(st.tuples(OPS, st.integers(0, 50), st.integers(1, 4)), max_size=40))
def test_counters_match_count_star_after_random_transitions(
    module_repo: Repository, ops: list[tuple[str, int, int]]
) -> None:
    repo = module_repo
    with repo.engine.begin() as conn:
        conn.execute(text("TRUNCATE tenants, files, jobs, nodes CASCADE"))
    tenant = repo.tenants.create_tenant("prop")
    f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"{}")
    jobs = []
    for j in range(2):
        job = repo.jobs.create_job(
            tenant.id, f.id, "/v1/completions", "1h", datetime.now(UTC) + timedelta(hours=1 + j)
        )
        repo.ingest.insert_items(job.id, (NewItem(i, f"c{i}", "{}", 8, 10, 128) for i in range(6)))
        repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        jobs.append(job.id)

    reserved: list[ClaimedItem] = []
    running: list[tuple[ClaimedItem, int]] = []
    finished: list[tuple[ClaimedItem, int]] = []
    fence = 0
    for op, pick, n in ops:
        try:
            if op == "claim":
                reserved += claim(repo, "n", n)
            elif op == "start":
                # One claim's start: the first ``pick`` items start, the next is held (as a
                # worker holds one it refuses), the rest are left in the queue.
                opened = repo.claims.open_claim("n", n, 30)
                items = opened.items
                go = items[: pick % (len(items) + 1)]
                hold = items[len(go) : len(go) + 1]
                starts = [
                    Start(c.id, c.attempt, f"l{fence + k}", fence + k, 128, 10)
                    for k, c in enumerate(go, start=1)
                ]
                if opened.open:
                    applied = repo.claims.start_claim(
                        opened, starts, [(c.id, c.attempt) for c in hold]
                    )
                    assert sorted(applied) == sorted(c.id for c in go)
                running += [(c, fence + k) for k, c in enumerate(go, start=1)]
                reserved += hold
                fence += len(go)
            elif op in ("finish_ok", "finish_err") and running:
                c, fen = running.pop(pick % len(running))
                state = ItemState.SUCCEEDED if op == "finish_ok" else ItemState.FAILED
                repo.items.finish(
                    [Finish(c.id, c.attempt, fen, state, result="r", output_tokens=n)]
                )
                finished.append((c, fen))
            elif op == "stale_finish" and finished:
                c, fen = finished[pick % len(finished)]
                assert repo.items.finish([Finish(c.id, c.attempt, fen, ItemState.SUCCEEDED)]) == []
            elif op == "preempt" and running:
                c, fen = running.pop(pick % len(running))
                repo.items.preempt(c.id, c.attempt, fen, partial_output="p", partial_tokens=n)
            elif op in ("defer", "release", "fail_reserved") and reserved:
                c = reserved.pop(pick % len(reserved))
                if op == "fail_reserved":
                    repo.items.fail(c.id, c.attempt, "bad")
                else:
                    target = ItemState.DEFERRED if op == "defer" else ItemState.QUEUED
                    repo.items.give_back(c.id, c.attempt, target)
            elif op == "reap":
                with repo.engine.begin() as conn:
                    conn.execute(
                        text(
                            "UPDATE items SET lease_expires_at = now() - interval '1 s' "
                            "WHERE state IN ('reserved', 'running') AND id % 3 = :m"
                        ),
                        {"m": pick % 3},
                    )
                repo.recovery.reap_lost()
            elif op == "cancel_unstarted":
                repo.items.end_items(jobs[pick % 2], ItemState.CANCELLED, only_unstarted=True)
            elif op == "drop":
                repo.claims.drop_claim(repo.claims.open_claim("n", n, 30))
            elif op == "heartbeat":
                repo.claims.heartbeat([(c.id, c.attempt) for c in reserved], 30)
        except StaleWrite:
            # A write by an attempt the reaper or a cancel already overtook: refused, as it
            # must be. The counters must still agree below.
            pass
        for job_id in jobs:
            counts = repo.jobs.get_job(None, job_id).counts
            truth = repo.stats.counted_states(job_id)
            assert {s: counts.count(s) for s in ItemState} == {
                s: truth.get(s, 0) for s in ItemState
            }, op
            assert counts.total == 6
