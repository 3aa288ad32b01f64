"""The repository on a real Postgres: claims, guarded transitions, counters, tenants."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from sqlalchemy import text

from backfill.config import libpq_url
from backfill.errors import Conflict, IllegalTransition, NotFound, StaleWrite
from backfill.states import ItemState, JobState
from backfill.store import Finish, JobRecord, NewItem, Repository, Start, key_digest
from tests.integration.claiming import claim
from tests.integration.support_sql import query_rows


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    r = Repository.connect(database_url, pool_size=10)
    yield r
    r.close()


def _job(
    repo: Repository, n: int, *, deadline_s: float = 3600, tenant: str | None = None
) -> JobRecord:
    tenant_id = tenant or repo.tenants.create_tenant(f"t{datetime.now(UTC).timestamp()}").id
    f = repo.files.create_file(tenant_id, "batch", "in.jsonl", b"{}")
    job = repo.jobs.create_job(
        tenant_id,
        f.id,
        "/v1/chat/completions",
        "24h",
        datetime.now(UTC) + timedelta(seconds=deadline_s),
    )
    repo.ingest.insert_items(
        job.id,
        (NewItem(i, f"req-{i}", '{"messages": []}', 16, 100, 128) for i in range(n)),
    )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    return job


def _assert_counters_match(repo: Repository, job_id: str) -> None:
    counts = repo.jobs.get_job(None, job_id).counts
    truth = repo.stats.counted_states(job_id)
    for state in ItemState:
        assert counts.count(state) == truth.get(state, 0), state
    assert counts.total == sum(truth.values())


def test_claim_hands_out_earliest_deadline_first(repo: Repository) -> None:
    # Within one tenant (tenants share a node by weight: tests/integration/test_fair_share.py).
    tenant = repo.tenants.create_tenant("edf").id
    late = _job(repo, 3, deadline_s=7200, tenant=tenant)
    early = _job(repo, 3, deadline_s=600, tenant=tenant)
    claimed = claim(repo, "n1", 4)
    assert [c.job_id for c in claimed] == [early.id] * 3 + [late.id]
    assert all(c.attempt == 1 for c in claimed)
    _assert_counters_match(repo, early.id)
    _assert_counters_match(repo, late.id)


def test_concurrent_claimers_never_share_an_item(repo: Repository) -> None:
    job = _job(repo, 3000)
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer() -> None:
        try:
            while batch := claim(repo, "n1", 37):
                with lock:
                    seen.extend(c.id for c in batch)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=claimer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    dupes = [i for i, n in Counter(seen).items() if n > 1]
    assert dupes == []
    assert len(seen) == 3000
    assert repo.jobs.get_job(None, job.id).counts.count(ItemState.RESERVED) == 3000
    _assert_counters_match(repo, job.id)


def test_claim_skips_items_not_yet_due_and_items_past_their_deadline(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 2)
    first = claim(repo, "n1", 1)[0]
    repo.items.give_back(
        first.id,
        first.attempt,
        ItemState.DEFERRED,
        retry_after_s=3600,
    )
    with psycopg.connect(libpq_url(database_url)) as conn:
        conn.execute(
            "UPDATE items SET deadline = now() - interval '1 s' WHERE id <> %s", (first.id,)
        )
    assert claim(repo, "n1", 10) == []
    _assert_counters_match(repo, job.id)


def test_a_stale_attempt_cannot_finish_after_the_item_was_reaped_and_reclaimed(
    repo: Repository, database_url: str
) -> None:
    job = _job(repo, 1)
    old = claim(repo, "n1", 1, leases=[("a", 1)])[0]
    # The worker goes silent: its claim expires and the reaper takes the item back.
    with psycopg.connect(libpq_url(database_url)) as conn:
        conn.execute("UPDATE items SET lease_expires_at = now() - interval '1 s'")
    reaped = repo.recovery.reap_lost()
    assert [r.item_id for r in reaped] == [old.id]
    assert reaped[0].lease_id == "a"
    new = claim(repo, "n2", 1, leases=[("b", 2)])[0]
    assert new.id == old.id
    assert new.attempt == old.attempt + 1
    # The old worker wakes up and tries to write its result: nothing applies.
    stale = Finish(old.id, old.attempt, 1, ItemState.SUCCEEDED, result="old", output_tokens=3)
    assert repo.items.finish([stale]) == []
    with pytest.raises(StaleWrite):
        repo.items.preempt(old.id, old.attempt, 1, partial_output="x", partial_tokens=1)
    fresh = Finish(new.id, new.attempt, 2, ItemState.SUCCEEDED, result="new", output_tokens=4)
    assert repo.items.finish([fresh]) == [new.id]
    # A second delivery of the same finish is also dropped: no item completes twice.
    assert repo.items.finish([fresh]) == []
    items = repo.items.items(job.id)
    assert [(i.state, i.result) for i in items] == [(ItemState.SUCCEEDED, "new")]
    counts = repo.jobs.get_job(None, job.id).counts
    assert counts.output_tokens == 4
    _assert_counters_match(repo, job.id)


def test_wrong_fencing_token_is_rejected(repo: Repository) -> None:
    _job(repo, 1)
    c = claim(repo, "n1", 1, leases=[("a", 10)])[0]
    assert repo.items.finish([Finish(c.id, c.attempt, 9, ItemState.SUCCEEDED, result="r")]) == []
    with pytest.raises(StaleWrite):
        repo.items.fail(c.id, c.attempt, "boom", fencing_token=9)
    repo.items.fail(c.id, c.attempt, "boom", fencing_token=10)


def test_illegal_transitions_raise_before_touching_the_database(repo: Repository) -> None:
    with pytest.raises(IllegalTransition):
        repo.items.give_back(1, 1, ItemState.SUCCEEDED)
    with pytest.raises(IllegalTransition):
        repo.items.finish([Finish(1, 1, 1, ItemState.PREEMPTED)])
    with pytest.raises(IllegalTransition):
        repo.items.end_items("batch_x", ItemState.SUCCEEDED)


def test_preempted_item_keeps_its_progress_and_is_claimed_again(repo: Repository) -> None:
    job = _job(repo, 1)
    c = claim(repo, "n1", 1, leases=[("a", 5)])[0]
    repo.items.preempt(c.id, c.attempt, 5, partial_output="Once upon", partial_tokens=2)
    again = claim(repo, "n1", 1)[0]
    assert again.id == c.id
    assert again.partial_output == "Once upon"
    assert again.partial_tokens == 2
    assert again.preemptions == 1
    _assert_counters_match(repo, job.id)


def test_heartbeat_extends_only_live_claims(repo: Repository) -> None:
    _job(repo, 2)
    a, b = claim(repo, "n1", 2)
    repo.items.give_back(b.id, b.attempt, ItemState.QUEUED)
    assert repo.claims.heartbeat(
        [(a.id, a.attempt), (b.id, b.attempt), (a.id, a.attempt + 1)], 30
    ) == [a.id]


def test_cancel_ends_unstarted_items_and_reports_active_ones(repo: Repository) -> None:
    job = _job(repo, 4)
    a, b = claim(repo, "n1", 2, leases=[("la", 1)])
    # b is claimed but not started (held): it ends with the unstarted ones, holding no lease.
    unstarted = repo.items.end_items(job.id, ItemState.CANCELLED, only_unstarted=True)
    assert [(r.item_id, r.lease_id) for r in unstarted] == [(b.id, None)]
    assert repo.jobs.get_job(None, job.id).counts.count(ItemState.CANCELLED) == 3
    active = repo.items.end_items(job.id, ItemState.CANCELLED)
    assert [(r.item_id, r.lease_id) for r in active] == [(a.id, "la")]
    assert repo.recovery.active_leases() == []
    _assert_counters_match(repo, job.id)


def test_active_leases_are_what_the_ledger_is_rebuilt_from(repo: Repository) -> None:
    _job(repo, 3)
    a, b, _ = claim(repo, "n1", 3, leases=[("la", 42)], reservation_tokens=256)
    rows = {r.item_id: r for r in repo.recovery.active_leases()}
    assert set(rows) >= {a.id, b.id}
    assert (rows[a.id].lease_id, rows[a.id].fencing_token, rows[a.id].reservation_tokens) == (
        "la",
        42,
        256,
    )
    assert rows[b.id].lease_id is None


def test_job_transitions_are_guarded_and_audited(repo: Repository) -> None:
    job = _job(repo, 1)
    with pytest.raises(StaleWrite):
        repo.jobs.move_job(job.id, JobState.COMPLETED)
    repo.jobs.move_job(job.id, JobState.CANCELLING, reason="user asked")
    repo.jobs.move_job(job.id, JobState.CANCELLED)
    with pytest.raises(StaleWrite):
        repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    with pytest.raises(NotFound):
        repo.jobs.move_job("batch_nope", JobState.CANCELLED)
    events = repo.jobs.job_events(job.id)
    assert [e[1] for e in events] == ["validating", "in_progress", "cancelling", "cancelled"]
    assert events[2][2] == "user asked"
    got = repo.jobs.get_job(job.tenant_id, job.id)
    assert got.timestamps["cancelled_at"] is not None


def test_jobs_are_scoped_to_their_tenant(repo: Repository) -> None:
    job = _job(repo, 1)
    other = repo.tenants.create_tenant("other")
    with pytest.raises(NotFound):
        repo.jobs.get_job(other.id, job.id)
    assert repo.jobs.list_jobs(other.id) == []
    assert [j.id for j in repo.jobs.list_jobs(job.tenant_id)] == [job.id]


def test_idempotent_create_returns_the_first_job(repo: Repository) -> None:
    t = repo.tenants.create_tenant("acme")
    f = repo.files.create_file(t.id, "batch", "in.jsonl", b"{}")
    deadline = datetime.now(UTC) + timedelta(hours=1)
    a = repo.jobs.create_job(t.id, f.id, "/v1/completions", "1h", deadline, idempotency_key="k")
    b = repo.jobs.create_job(t.id, f.id, "/v1/completions", "1h", deadline, idempotency_key="k")
    c = repo.jobs.create_job(t.id, f.id, "/v1/completions", "1h", deadline)
    assert a.id == b.id != c.id


def test_api_keys_are_stored_only_as_digests(repo: Repository) -> None:
    t = repo.tenants.create_tenant("acme")
    key = repo.tenants.create_api_key(t.id)
    assert repo.tenants.tenant_for_key(key) == t
    assert repo.tenants.tenant_for_key(key + "x") is None
    with repo.engine.connect() as conn:
        stored = conn.execute(text("SELECT digest, prefix FROM api_keys")).one()
    assert stored[0] == key_digest(key)
    assert key not in stored[0]
    repo.tenants.revoke_api_key(key)
    assert repo.tenants.tenant_for_key(key) is None
    with pytest.raises(NotFound):
        repo.tenants.revoke_api_key(key)


def test_duplicate_tenant_name_is_a_conflict(repo: Repository) -> None:
    repo.tenants.create_tenant("acme")
    with pytest.raises(Conflict):
        repo.tenants.create_tenant("acme")


def test_exact_token_counts_update_the_job_totals(repo: Repository) -> None:
    job = _job(repo, 2)
    items = claim(repo, "n1", 2)
    repo.ingest.set_prompt_tokens([(items[0].id, 150, 256), (items[1].id, 90, 128)])
    assert repo.jobs.get_job(None, job.id).counts.prompt_tokens == 240


def test_every_attempt_leaves_one_audit_row_with_its_outcome(repo: Repository) -> None:
    _job(repo, 1)
    c1 = claim(repo, "n1", 1)[0]
    repo.items.give_back(c1.id, c1.attempt, ItemState.DEFERRED, detail="no slack")
    c2 = claim(repo, "n1", 1, leases=[("l2", 2)])[0]
    repo.items.preempt(c2.id, c2.attempt, 2, partial_output="ab", partial_tokens=2)
    opened = repo.claims.open_claim("n2", 1, 30)
    (c3,) = opened.items
    applied = repo.claims.start_claim(
        opened,
        [Start(c3.id, c3.attempt, "l3", 3, 128, 100), Start(c3.id, c3.attempt - 1, "x", 9, 1, 1)],
    )
    assert applied == [c3.id]
    repo.items.finish(
        [Finish(c3.id, c3.attempt, 3, ItemState.SUCCEEDED, result="r", output_tokens=7)]
    )
    rows = query_rows(
        repo,
        "SELECT attempt, node, lease_id, fencing_token, outcome, output_tokens "
        "FROM attempts ORDER BY attempt",
    )
    assert [tuple(r) for r in rows] == [
        (1, "n1", None, None, "deferred", None),
        (2, "n1", "l2", 2, "preempted", 2),
        (3, "n2", "l3", 3, "succeeded", 7),
    ]


def test_requeue_keeps_progress_without_counting_a_preemption(repo: Repository) -> None:
    job = _job(repo, 1)
    c = claim(repo, "n1", 1, leases=[("a", 3)])[0]
    with pytest.raises(StaleWrite):
        repo.items.requeue(c.id, c.attempt, 4, partial_output="x", partial_tokens=1, detail="d")
    repo.items.requeue(
        c.id, c.attempt, 3, partial_output="Hello", partial_tokens=1, detail="engine unreachable"
    )
    again = claim(repo, "n1", 1)[0]
    assert (again.partial_output, again.partial_tokens, again.preemptions) == ("Hello", 1, 0)
    _assert_counters_match(repo, job.id)


def test_an_item_that_cannot_meet_its_deadline_expires_unstarted(repo: Repository) -> None:
    job = _job(repo, 1)
    c = claim(repo, "n1", 1)[0]
    repo.items.expire_claimed(c.id, c.attempt, "needs 90 s, 10 s left")
    with pytest.raises(StaleWrite):
        repo.items.expire_claimed(c.id, c.attempt, "again")
    assert repo.items.items(job.id)[0].state is ItemState.EXPIRED
    _assert_counters_match(repo, job.id)


def test_ledger_epochs_only_grow(repo: Repository) -> None:
    first = repo.recovery.next_ledger_epoch()
    assert repo.recovery.next_ledger_epoch() == first + 1


def test_partial_output_keeps_any_code_point_even_nul(repo: Repository) -> None:
    _job(repo, 1)
    c = claim(repo, "n1", 1, leases=[("a", 1)])[0]
    odd = "nul\x00 tab\t emoji\U0001f600 \ud7ff end"
    repo.items.preempt(c.id, c.attempt, 1, partial_output=odd, partial_tokens=5)
    again = claim(repo, "n1", 1)[0]
    assert again.partial_output == odd
