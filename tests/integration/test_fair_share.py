"""Tenants share each node's batch capacity by weight (issue 17), on a real Postgres.

Claims: a tenant's share is of the batch sequences a node holds (reserved or running), so
one tenant's deep backlog or earlier deadlines no longer starve the others, an idle tenant's
share goes to the rest, and earliest-deadline-first still orders each tenant's own items.
Feasibility at create: a batch is judged against the share its tenant will get, not behind
every other tenant's backlog.
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from batch_api_support import chat_file

from backfill import batches
from backfill.batch_input import forecast_tokens_upper_bound
from backfill.config import Settings
from backfill.refusals import DeadlineInfeasible
from backfill.states import JobState
from backfill.store import ClaimedItem, JobRecord, NewItem, Repository
from tests.integration.claiming import claim


@pytest.fixture
def repo(database_url: str) -> Iterator[Repository]:
    r = Repository.connect(database_url, pool_size=10)
    yield r
    r.close()


def _job(repo: Repository, tenant_id: str, n: int, *, deadline_s: float = 3600) -> JobRecord:
    f = repo.files.create_file(tenant_id, "batch", "in.jsonl", b"{}")
    job = repo.jobs.create_job(
        tenant_id,
        f.id,
        "/v1/chat/completions",
        "24h",
        datetime.now(UTC) + timedelta(seconds=deadline_s),
    )
    repo.ingest.insert_items(
        job.id, (NewItem(i, f"req-{i}", '{"messages": []}', 16, 100, 128) for i in range(n))
    )
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    return job


def _tenant_of(jobs: dict[str, str], claimed: list[ClaimedItem]) -> list[str]:
    return [jobs[c.job_id] for c in claimed]


_FENCES = itertools.count(1000)


def _run(repo: Repository, node: str, limit: int) -> list[ClaimedItem]:
    """Claim items and start them all, as the worker does once their leases are held."""
    leases = [(f"ls_{fence}", fence) for fence in itertools.islice(_FENCES, limit)]
    return claim(repo, node, limit, leases=leases)


def test_claims_interleave_tenants_while_both_have_work(repo: Repository) -> None:
    a = repo.tenants.create_tenant("a").id
    b = repo.tenants.create_tenant("b").id
    # A submitted first, with far more work and earlier deadlines: plain EDF gives A all.
    job_a = _job(repo, a, 60, deadline_s=600)
    job_b = _job(repo, b, 60, deadline_s=7200)
    jobs = {job_a.id: "a", job_b.id: "b"}
    claimed = claim(repo, "n1", 10)
    assert Counter(_tenant_of(jobs, claimed)) == {"a": 5, "b": 5}
    # Handed out in an interleaved order: the dispatcher starts a prefix of a claim when the
    # slack is short and gives the rest back.
    assert Counter(_tenant_of(jobs, claimed[:4])) == {"a": 2, "b": 2}


def test_a_tenants_share_counts_what_the_node_already_holds_for_it(repo: Repository) -> None:
    a = repo.tenants.create_tenant("a").id
    b = repo.tenants.create_tenant("b").id
    job_a = _job(repo, a, 40, deadline_s=600)
    first = _run(repo, "n1", 6)  # only A has work yet: the whole node is A's
    assert {c.job_id for c in first} == {job_a.id}
    job_b = _job(repo, b, 40, deadline_s=7200)
    jobs = {job_a.id: "a", job_b.id: "b"}
    # n1 runs six of A's: the next six of n1 go to B, until both hold the same.
    assert Counter(_tenant_of(jobs, claim(repo, "n1", 8))) == {"b": 7, "a": 1}
    # Each node shares its own capacity: on n2, nobody holds anything yet.
    assert Counter(_tenant_of(jobs, claim(repo, "n2", 4))) == {"a": 2, "b": 2}


def test_an_idle_tenants_share_goes_to_the_others(database_url: str, repo: Repository) -> None:
    a = repo.tenants.create_tenant("a").id
    b = repo.tenants.create_tenant("b").id
    idle = repo.tenants.create_tenant("idle").id
    job_a = _job(repo, a, 2, deadline_s=600)
    job_b = _job(repo, b, 40, deadline_s=7200)
    job_idle = _job(repo, idle, 4, deadline_s=60)
    # The idle tenant's job is in progress, but another node holds all of its items.
    elsewhere = Repository.connect(database_url, pool_size=1, fair_share=False)
    try:
        assert {c.job_id for c in claim(elsewhere, "n2", 4)} == {job_idle.id}
    finally:
        elsewhere.close()
    jobs = {job_a.id: "a", job_b.id: "b", job_idle.id: "idle"}
    # Work-conserving: what A and the idle tenant cannot use goes to B.
    assert Counter(_tenant_of(jobs, claim(repo, "n1", 10))) == {"a": 2, "b": 8}
    assert Counter(_tenant_of(jobs, claim(repo, "n1", 10))) == {"b": 10}


def test_earliest_deadline_first_holds_within_a_tenant(repo: Repository) -> None:
    a = repo.tenants.create_tenant("a").id
    b = repo.tenants.create_tenant("b").id
    late = _job(repo, a, 5, deadline_s=7200)
    early = _job(repo, a, 5, deadline_s=900)
    other = _job(repo, b, 20, deadline_s=60)
    claimed = claim(repo, "n1", 8)
    mine = [c for c in claimed if c.job_id in {late.id, early.id}]
    assert [c.job_id for c in mine] == [early.id] * 4
    assert sum(c.job_id == other.id for c in claimed) == 4
    deadlines = [c.deadline for c in mine]
    assert deadlines == sorted(deadlines)


def test_weights_are_respected(repo: Repository) -> None:
    heavy = repo.tenants.create_tenant("heavy", weight=2).id
    light = repo.tenants.create_tenant("light").id
    assert repo.tenants.tenant_by_name("heavy").weight == 2
    assert repo.tenants.tenant_by_name("light").weight == 1
    job_h = _job(repo, heavy, 60, deadline_s=7200)
    job_l = _job(repo, light, 60, deadline_s=600)
    jobs = {job_h.id: "heavy", job_l.id: "light"}
    claimed = _run(repo, "n1", 9)
    assert Counter(_tenant_of(jobs, claimed)) == {"heavy": 6, "light": 3}
    # The weight is the tenant's record: changed, the next claims follow it.
    repo.tenants.set_tenant_weight("light", 4)
    assert Counter(_tenant_of(jobs, claim(repo, "n1", 9))) == {"light": 9}
    # light holds 12 at weight 4 (3 a unit), heavy 6 at weight 2 (3 a unit): even again.
    assert Counter(_tenant_of(jobs, claim(repo, "n1", 6))) == {"light": 4, "heavy": 2}


def test_without_fair_share_claims_are_earliest_deadline_first_across_tenants(
    database_url: str, repo: Repository
) -> None:
    a = repo.tenants.create_tenant("a").id
    b = repo.tenants.create_tenant("b").id
    job_a = _job(repo, a, 20, deadline_s=600)
    _job(repo, b, 20, deadline_s=7200)
    plain = Repository.connect(database_url, pool_size=1, fair_share=False)
    try:
        assert {c.job_id for c in claim(plain, "n1", 10)} == {job_a.id}
    finally:
        plain.close()


def test_concurrent_fair_claimers_never_share_an_item(repo: Repository) -> None:
    tenants = [repo.tenants.create_tenant(f"t{i}", weight=1 + i).id for i in range(3)]
    total = 0
    for i, t in enumerate(tenants):
        _job(repo, t, 400, deadline_s=600 * (i + 1))
        total += 400
    seen: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def claimer(node: str) -> None:
        try:
            while batch := claim(repo, node, 23):
                with lock:
                    seen.extend(c.id for c in batch)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=claimer, args=(f"n{i % 3}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [i for i, n in Counter(seen).items() if n > 1] == []
    assert len(seen) == total


# ---------------------------------------------------------------------------------------------
# Feasibility at create


def _submit(
    repo: Repository, settings: Settings, tenant: str, lines: int, window: str
) -> JobRecord:
    record = repo.tenants.tenant_by_name(tenant)
    # Checked in the request, whatever the file's size: the backlog ahead is what is judged.
    settings = settings.model_copy(update={"ingest_inline_bytes": 1 << 30})
    upload = batches.upload_file(
        repo, settings, record.id, filename="in.jsonl", purpose="batch", content=chat_file(lines)
    )
    request = batches.BatchRequest(upload.id, "/v1/chat/completions", window)
    return batches.create_batch(repo, settings, record, request)


def test_one_tenants_long_window_backlog_leaves_another_tenants_small_batch_feasible(
    repo: Repository, settings: Settings
) -> None:
    per_line = forecast_tokens_upper_bound(chat_file(1))
    # A batch of 100 lines takes 10 minutes alone at this throughput.
    slow = settings.model_copy(update={"batch_throughput_tokens_per_s": 100 * per_line / 600})
    repo.tenants.create_tenant("big")
    repo.tenants.create_tenant("small")
    # About 8 hours of work, in a 7-day window.
    big = _submit(repo, slow, "big", 5000, "7d")
    assert big.state is JobState.IN_PROGRESS
    # Behind the whole backlog it would finish in 8 hours; at half the node, in 20 minutes.
    small = _submit(repo, slow, "small", 100, "30m")
    assert small.state is JobState.IN_PROGRESS
    # Its tenant's share is half the node while the other has backlog: with the first 100
    # lines queued, 200 more are 30 minutes of work alone and an hour at half the node.
    with pytest.raises(DeadlineInfeasible):
        _submit(repo, slow, "small", 200, "30m")
    # A tenant's own backlog still counts in full against its own new batches.
    with pytest.raises(DeadlineInfeasible):
        _submit(repo, slow, "big", 10, "1h")


def test_without_fair_share_every_tenants_backlog_is_ahead(
    repo: Repository, settings: Settings
) -> None:
    per_line = forecast_tokens_upper_bound(chat_file(1))
    slow = settings.model_copy(
        update={"batch_throughput_tokens_per_s": 100 * per_line / 600, "fair_share": False}
    )
    repo.tenants.create_tenant("big")
    repo.tenants.create_tenant("small")
    _submit(repo, slow, "big", 5000, "7d")
    with pytest.raises(DeadlineInfeasible):
        _submit(repo, slow, "small", 100, "30m")
