"""Summarisation jobs over real Postgres: a job spanning several batch files under one
deadline, long documents map-reduced by the driver, cancel mid-job, and a driver killed
mid-way that loses and doubles nothing; an ended job purged past its retention."""

from __future__ import annotations

import json
import re

import pytest
from batch_api_support import chat_file, run_worker
from sqlalchemy import text

from backfill import batches
from backfill.config import Settings
from backfill.errors import BackfillError, NotFound
from backfill.finalize import finalize_ready_jobs
from backfill.purge_pace import PurgePace
from backfill.refusals import DeadlineInfeasible, InvalidRequest, LimitReached
from backfill.states import JobState
from backfill.store import Repository
from backfill.store.summaries import SummaryBatches, SummaryOutcomes
from backfill.summarize import driver, jobs
from backfill.summarize.job_plan import JobShape
from backfill.summarize.prompts import CHAT_URL
from backfill.summarize.reduce_plan import plan_reduce
from backfill.summarize.states import DocumentState, SummaryJobState
from tests.integration.claiming import claim
from tests.integration.support_sql import query_rows

pytestmark = pytest.mark.usefixtures("summary_counts_checked")

_TOKENS = re.compile(r"\w+|[^\w\s]|\s+")


def count(text_: str) -> int:
    return 1 + len(_TOKENS.findall(text_))


# A small context: a map chunk holds ~120 tokens of text, a reduce step 4 summaries.
SHAPE = JobShape(
    context_tokens=400, map_prompt_tokens=20, reduce_prompt_tokens=40, summary_tokens=64
)
LONG = "\n\n".join(
    f"Paragraph {i} of the long report. " + "It has several words in each sentence. " * 6
    for i in range(30)
)
SHORT = ["A short note.", "Another short note.", "A third one.", "Four.", "Five, the last."]


@pytest.fixture
def small_batches(settings: Settings) -> Settings:
    # Batch files of at most 4 lines: a job of a few documents spans several.
    return settings.model_copy(update={"max_lines_per_batch": 4, "node_live_s": 0.001})


def _new_job(repo: Repository, settings: Settings, window: str = "1h") -> tuple[str, str]:
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", SHAPE.summary_tokens, window)
    job = jobs.create_job(repo, settings, tenant, request, SHAPE)
    documents = [jobs.prepare_document(job, "long", LONG, count)]
    documents += [jobs.prepare_document(job, f"s{i}", t, count) for i, t in enumerate(SHORT)]
    documents.append(jobs.prepare_document(job, "blank", "   ", count))
    jobs.add_documents(repo, settings, tenant, job, documents)
    return tenant.id, job.id


def _batch_items(repo: Repository, job_id: str) -> list[tuple[str, str]]:
    rows = query_rows(
        repo,
        "SELECT i.job_id, i.custom_id FROM items i JOIN summary_batches b "
        "ON b.batch_id = i.job_id WHERE b.job_id = :j",
        j=job_id,
    )
    return [(r.job_id, r.custom_id) for r in rows]


def _run_to_end(repo: Repository, settings: Settings, job_id: str, rounds: int = 30) -> None:
    for _ in range(rounds):
        driver.drive(repo, settings)
        if repo.summary_jobs.get_summary_job(None, job_id).state is not SummaryJobState.IN_PROGRESS:
            return
        run_worker(repo)
    raise AssertionError("the job did not end")


def test_a_job_over_several_batch_files_map_reduces_its_long_document(
    repo: Repository, small_batches: Settings
) -> None:
    tenant_id, job_id = _new_job(repo, small_batches)
    job = repo.summary_jobs.get_summary_job(tenant_id, job_id)
    long_doc = repo.summary_reports.document_page(job_id, -1, 10)[0]
    chunks = long_doc.chunks
    assert chunks > 4  # longer than the context: split
    plan = plan_reduce(chunks, job.fan_in)
    assert plan.depth >= 1
    assert job.planned_steps == plan.nodes + len(SHORT)
    assert job.forecast_tokens > 0

    started = jobs.start_job(repo, small_batches, repo.tenants.tenant_by_id(tenant_id), job)
    assert started.state is SummaryJobState.IN_PROGRESS
    assert started.deadline is not None
    driver.drive(repo, small_batches)
    batch_ids = repo.summary_batches.summary_batch_ids(job_id)
    assert len(batch_ids) == -(-(chunks + len(SHORT)) // 4)  # several files, 4 lines each
    deadlines = {repo.jobs.get_job(tenant_id, b).deadline for b in batch_ids}
    assert deadlines == {started.deadline}  # one deadline for the whole job

    _run_to_end(repo, small_batches, job_id)
    assert repo.summary_jobs.get_summary_job(tenant_id, job_id).state is SummaryJobState.COMPLETED
    rows = {r.id: r for r in jobs.result_rows(repo, job_id)}
    assert rows["long"].summary == f"answer to 0:{plan.root}"
    assert rows["long"].chunks == chunks
    assert rows["long"].split_depth == plan.depth
    # Every step's usage is counted (the stand-in worker's answers report 5 and 3 tokens).
    assert (rows["long"].prompt_tokens, rows["long"].completion_tokens) == (
        5 * plan.nodes,
        3 * plan.nodes,
    )
    for i in range(len(SHORT)):
        assert rows[f"s{i}"].summary == f"answer to {i + 1}:0"
        assert rows[f"s{i}"].split_depth == 0
    assert rows["blank"].summary is None
    assert rows["blank"].error == "empty text"
    # Every step ran once: the map steps and each reduce step of the long document.
    ids = [cid for _, cid in _batch_items(repo, job_id)]
    assert sorted(ids) == sorted(
        [f"0:{n}" for n in range(plan.nodes)] + [f"{i + 1}:0" for i in range(len(SHORT))]
    )


def test_a_driver_killed_mid_way_loses_and_doubles_nothing(
    repo: Repository, small_batches: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id, job_id = _new_job(repo, small_batches)
    jobs.start_job(
        repo,
        small_batches,
        repo.tenants.tenant_by_id(tenant_id),
        repo.summary_jobs.get_summary_job(None, job_id),
    )
    real_set_batch = SummaryBatches.set_batch
    real_decide = SummaryOutcomes.decide_documents
    crashes = {"set_batch": 2, "decide": 2}

    def set_batch_then_die(self: SummaryBatches, *args: object) -> None:
        # The batch was made (its items stored) but the driver dies before noting it.
        if crashes["set_batch"]:
            crashes["set_batch"] -= 1
            raise BackfillError("the driver was killed")
        real_set_batch(self, *args)  # type: ignore[arg-type]

    def decide_then_die(self: SummaryOutcomes, *args: object) -> None:
        if crashes["decide"]:
            crashes["decide"] -= 1
            raise BackfillError("the driver was killed")
        real_decide(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(SummaryBatches, "set_batch", set_batch_then_die)
    monkeypatch.setattr(SummaryOutcomes, "decide_documents", decide_then_die)
    _run_to_end(repo, small_batches, job_id, rounds=40)
    assert crashes == {"set_batch": 0, "decide": 0}

    job = repo.summary_jobs.get_summary_job(tenant_id, job_id)
    assert job.state is SummaryJobState.COMPLETED
    long_doc = repo.summary_reports.document_page(job_id, -1, 1)[0]
    plan = plan_reduce(long_doc.chunks, job.fan_in)
    items = _batch_items(repo, job_id)
    ids = [cid for _, cid in items]
    assert len(ids) == len(set(ids)) == plan.nodes + len(SHORT)
    assert long_doc.state is DocumentState.SUCCEEDED
    assert long_doc.summary == f"answer to 0:{plan.root}"


def test_cancel_mid_job_cancels_its_batches_and_keeps_what_was_summarised(
    repo: Repository, small_batches: Settings
) -> None:
    tenant_id, job_id = _new_job(repo, small_batches)
    tenant = repo.tenants.tenant_by_id(tenant_id)
    jobs.start_job(repo, small_batches, tenant, repo.summary_jobs.get_summary_job(None, job_id))
    driver.drive(repo, small_batches)
    run_worker(repo, limit=3)  # three map steps end
    driver.drive(repo, small_batches)

    assert jobs.cancel_job(repo, tenant, job_id).state is SummaryJobState.CANCELLING
    driver.drive(repo, small_batches)
    job = repo.summary_jobs.get_summary_job(tenant_id, job_id)
    assert job.state is SummaryJobState.CANCELLED
    for batch_id in repo.summary_batches.summary_batch_ids(job_id):
        assert repo.jobs.get_job(tenant_id, batch_id).state in (
            JobState.CANCELLED,
            JobState.CANCELLING,
        )
    rows = list(jobs.result_rows(repo, job_id))
    assert {r.error for r in rows if r.summary is None} <= {"cancelled", "empty text"}
    assert run_worker(repo) == {}  # nothing of it is claimed any more
    assert claim(repo, "node-test", 100) == []


def test_a_bounded_round_cuts_so_many_steps_and_the_next_round_the_rest_once(
    repo: Repository, small_batches: Settings
) -> None:
    """The start's own round is bounded (it answers a request); nothing is lost or doubled
    between it and the rounds after."""
    tenant_id, job_id = _new_job(repo, small_batches)
    tenant = repo.tenants.tenant_by_id(tenant_id)
    jobs.start_job(repo, small_batches, tenant, repo.summary_jobs.get_summary_job(None, job_id))
    assert driver.drive_now(repo, small_batches, job_id, max_steps=3)
    assert len(_batch_items(repo, job_id)) == 3
    assert repo.summary_reports.summary_counts(job_id).unbatched_steps > 0
    driver.drive(repo, small_batches)
    items = _batch_items(repo, job_id)
    assert repo.summary_reports.summary_counts(job_id).unbatched_steps == 0
    assert len({custom_id for _, custom_id in items}) == len(items)
    long_chunks = repo.summary_reports.document_page(job_id, -1, 1)[0].chunks
    assert long_chunks > 3
    assert len(items) == long_chunks + len(SHORT)  # every map step, once


def test_reduce_steps_wait_for_the_jobs_queue_to_run_low_not_a_batch_each(
    repo: Repository, settings: Settings
) -> None:
    """A reduce step made while many of the job's map items still wait is not cut into a
    batch of its own (it would only queue behind them): it waits for the queue to run low,
    and the reduce steps of several documents then go out in one batch."""
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", SHAPE.summary_tokens, "1h")
    job = jobs.create_job(repo, settings, tenant, request, SHAPE)
    many = [f"Short note number {i}." for i in range(40)]
    documents = [jobs.prepare_document(job, f"long{i}", LONG, count) for i in range(2)]
    documents += [jobs.prepare_document(job, f"s{i}", t, count) for i, t in enumerate(many)]
    jobs.add_documents(repo, settings, tenant, job, documents)
    jobs.start_job(repo, settings, tenant, repo.summary_jobs.get_summary_job(None, job.id))
    driver.drive(repo, settings)
    assert len(repo.summary_batches.summary_batch_ids(job.id)) == 1  # every map step in one file
    chunks = repo.summary_reports.document_page(job.id, -1, 1)[0].chunks

    run_worker(repo, limit=chunks)  # the first long document's map items end; 40+ still wait
    driver.drive(repo, settings)
    held = repo.summary_reports.summary_counts(job.id).unbatched_steps
    assert held > 0  # its reduce steps were made ...
    assert (
        len(repo.summary_batches.summary_batch_ids(job.id)) == 1
    )  # ... and wait: no batch of their own

    run_worker(repo)  # every map item ends: nothing of the job waits now
    driver.drive(repo, settings)
    assert repo.summary_reports.summary_counts(job.id).unbatched_steps == 0
    assert (
        len(repo.summary_batches.summary_batch_ids(job.id)) == 2
    )  # both documents' reduce steps, one file
    _run_to_end(repo, settings, job.id)
    rows = {r.id: r for r in jobs.result_rows(repo, job.id)}
    assert all(rows[f"long{i}"].summary for i in range(2))
    assert all(rows[f"s{i}"].summary for i in range(len(many)))


def test_a_job_whose_whole_forecast_misses_its_deadline_is_refused_at_start(
    repo: Repository, small_batches: Settings
) -> None:
    slow = small_batches.model_copy(update={"batch_throughput_tokens_per_s": 1.0})
    tenant_id, job_id = _new_job(repo, slow, window="5m")
    job = repo.summary_jobs.get_summary_job(None, job_id)
    with pytest.raises(DeadlineInfeasible, match="earliest feasible"):
        jobs.start_job(repo, slow, repo.tenants.tenant_by_id(tenant_id), job)
    assert repo.summary_jobs.get_summary_job(None, job_id).state is SummaryJobState.RECEIVING
    assert repo.summary_batches.summary_batch_ids(job_id) == []


def test_a_driver_killed_between_making_a_batch_and_storing_its_items_stores_them_next_round(
    repo: Repository, small_batches: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_id, job_id = _new_job(repo, small_batches)
    jobs.start_job(
        repo,
        small_batches,
        repo.tenants.tenant_by_id(tenant_id),
        repo.summary_jobs.get_summary_job(None, job_id),
    )
    real_ingest = driver.ingest_items
    kills = {"left": 1}

    def killed_before_ingest(*args: object, **kwargs: object) -> object:
        if kills["left"]:
            kills["left"] -= 1
            raise BackfillError("the driver was killed")
        return real_ingest(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(driver, "ingest_items", killed_before_ingest)
    driver.drive(repo, small_batches)  # the first batch is created, its items not stored
    assert repo.summary_batches.summary_batch_ids(job_id) == []
    _run_to_end(repo, small_batches, job_id)
    job = repo.summary_jobs.get_summary_job(tenant_id, job_id)
    assert job.state is SummaryJobState.COMPLETED
    counts = repo.summary_reports.summary_counts(job_id)
    assert counts.documents == {DocumentState.SUCCEEDED: 6, DocumentState.FAILED: 1}
    ids = [cid for _, cid in _batch_items(repo, job_id)]
    assert len(ids) == len(set(ids)) == job.planned_steps


def test_past_its_deadline_a_job_makes_no_batch_and_ends_expired(
    repo: Repository, small_batches: Settings
) -> None:
    tenant_id, job_id = _new_job(repo, small_batches)
    jobs.start_job(
        repo,
        small_batches,
        repo.tenants.tenant_by_id(tenant_id),
        repo.summary_jobs.get_summary_job(None, job_id),
    )
    driver.drive(repo, small_batches)
    run_worker(repo)  # the map steps end; the long document's reduce steps are still to make
    batches = len(repo.summary_batches.summary_batch_ids(job_id))
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE summary_jobs SET deadline = now() - interval '1 second' WHERE id = :j"),
            {"j": job_id},
        )
    driver.drive(repo, small_batches)
    job = repo.summary_jobs.get_summary_job(tenant_id, job_id)
    assert job.state is SummaryJobState.EXPIRED
    assert (
        len(repo.summary_batches.summary_batch_ids(job_id)) == batches
    )  # no reduce batch was made
    rows = {r.id: r for r in jobs.result_rows(repo, job_id)}
    assert rows["long"].summary is None
    assert rows["long"].error is not None
    assert "expired" in rows["long"].error
    assert rows["s0"].summary == "answer to 1:0"  # what was summarised is kept


def _ended_long_ago(repo: Repository, job_id: str) -> None:
    """The summary job and its batches ended 31 days ago."""
    with repo.engine.begin() as conn:
        conn.execute(
            text("UPDATE summary_jobs SET ended_at = now() - interval '31 days' WHERE id = :j"),
            {"j": job_id},
        )
        conn.execute(
            text(
                "UPDATE jobs SET completed_at = now() - interval '31 days' WHERE id IN "
                "(SELECT batch_id FROM summary_batches WHERE job_id = :j)"
            ),
            {"j": job_id},
        )


def test_a_summary_job_past_its_retention_is_purged_with_its_batches_in_bounded_chunks(
    repo: Repository, small_batches: Settings
) -> None:
    old_tenant, old = _new_job(repo, small_batches)
    jobs.start_job(
        repo,
        small_batches,
        repo.tenants.tenant_by_id(old_tenant),
        repo.summary_jobs.get_summary_job(None, old),
    )
    _run_to_end(repo, small_batches, old)
    finalize_ready_jobs(repo)  # the maintenance tick ends its batches
    recent_tenant = repo.tenants.create_tenant("recent")
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", SHAPE.summary_tokens, "1h")
    recent = jobs.create_job(repo, small_batches, recent_tenant, request, SHAPE)
    jobs.add_documents(
        repo,
        small_batches,
        recent_tenant,
        recent,
        [jobs.prepare_document(recent, "a", "A note.", count)],
    )
    jobs.cancel_job(repo, recent_tenant, recent.id)  # ended now: kept
    old_batches = repo.summary_batches.summary_batch_ids(old)
    assert len(old_batches) > 2
    _ended_long_ago(repo, old)

    def rows(table: str, job_id: str) -> int:
        with repo.engine.connect() as conn:
            return int(
                conn.execute(
                    text(f"SELECT count(*) FROM {table} WHERE job_id = :j"), {"j": job_id}
                ).scalar_one()
            )

    assert rows("summary_steps", old) > 10
    assert rows("summary_documents", old) == 7
    # Each call deletes at most its rows, in chunks: the job goes over several calls (on a
    # clock that stands still, so only the rows bound them).
    four_by_ten = PurgePace(max_rows=4, rows_per_tick=10)
    first = repo.retention.purge_ended_jobs(30 * 86_400.0, four_by_ten, clock=lambda: 0.0)
    assert first.rows < 10 + 4  # a chunk may begin just under the bound
    calls = 1
    while repo.summary_jobs.list_summary_jobs(old_tenant) and calls < 40:
        report = repo.retention.purge_ended_jobs(30 * 86_400.0, four_by_ten, clock=lambda: 0.0)
        assert report.rows < 10 + 4
        calls += 1
    assert repo.summary_jobs.list_summary_jobs(old_tenant) == []
    for table in ("summary_steps", "summary_documents", "summary_batches"):
        assert rows(table, old) == 0
    for batch_id in old_batches:  # its batches went with it, under the same retention
        assert rows("items", batch_id) == 0
        with pytest.raises(NotFound):
            repo.jobs.get_job(old_tenant, batch_id)
    # What ended since stays whole.
    assert [j.id for j in repo.summary_jobs.list_summary_jobs(recent_tenant.id)] == [recent.id]
    assert rows("summary_documents", recent.id) == 1


def test_a_summary_job_counts_as_one_active_batch_whatever_batches_it_makes(
    repo: Repository, small_batches: Settings
) -> None:
    # A limit of 2: the job's several batch files count as the one thing the tenant sent.
    limited = small_batches.model_copy(update={"max_active_batches_per_tenant": 2})
    tenant_id, job_id = _new_job(repo, limited)
    tenant = repo.tenants.tenant_by_id(tenant_id)
    jobs.start_job(repo, limited, tenant, repo.summary_jobs.get_summary_job(None, job_id))
    driver.drive(repo, limited)
    assert len(repo.summary_batches.summary_batch_ids(job_id)) > 2  # more batches than the limit
    assert repo.jobs.count_active_jobs(tenant_id) == 1
    # One more job fits; a third is refused at create and at start, with the limit named.
    request = jobs.SummaryJobRequest("tiny-model", "Summarise.", SHAPE.summary_tokens, "1h")
    second = jobs.create_job(repo, limited, tenant, request, SHAPE)
    third = jobs.create_job(repo, limited, tenant, request, SHAPE)
    for job in (second, third):
        jobs.add_documents(
            repo, limited, tenant, job, [jobs.prepare_document(job, "a", "A note.", count)]
        )
    jobs.start_job(repo, limited, tenant, second)
    assert repo.jobs.count_active_jobs(tenant_id) == 2
    with pytest.raises(LimitReached, match="the limit is 2"):
        jobs.start_job(repo, limited, tenant, third)
    assert repo.summary_jobs.get_summary_job(None, third.id).state is SummaryJobState.RECEIVING
    with pytest.raises(LimitReached, match="the limit is 2"):
        jobs.create_job(repo, limited, tenant, request, SHAPE)
    with pytest.raises(LimitReached, match="the limit is 2"):
        batches.create_batch(
            repo,
            limited,
            tenant,
            batches.BatchRequest(_batch_file(repo, limited, tenant_id), CHAT_URL, "24h"),
        )
    # The jobs ending free their places, their batches with them.
    _run_to_end(repo, limited, job_id)
    assert repo.summary_jobs.get_summary_job(None, second.id).state is SummaryJobState.COMPLETED
    assert repo.jobs.count_active_jobs(tenant_id) == 0
    assert jobs.start_job(repo, limited, tenant, third).state is SummaryJobState.IN_PROGRESS


def _batch_file(repo: Repository, settings: Settings, tenant_id: str) -> str:
    return batches.upload_file(
        repo, settings, tenant_id, filename="in.jsonl", purpose="batch", content=chat_file(1)
    ).id


def test_a_jobs_sampling_settings_reach_every_map_and_reduce_request(
    repo: Repository, small_batches: Settings
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    sampling = {"temperature": 0.0, "repetition_penalty": 1.1}
    request = jobs.SummaryJobRequest(
        "tiny-model", "Summarise.", SHAPE.summary_tokens, "1h", sampling
    )
    job = jobs.create_job(repo, small_batches, tenant, request, SHAPE)
    assert repo.summary_jobs.get_summary_job(None, job.id).sampling == sampling
    jobs.add_documents(
        repo, small_batches, tenant, job, [jobs.prepare_document(job, "long", LONG, count)]
    )
    jobs.start_job(repo, small_batches, tenant, repo.summary_jobs.get_summary_job(None, job.id))
    _run_to_end(repo, small_batches, job.id)
    bodies = []
    for batch_id in repo.summary_batches.summary_batch_ids(job.id):
        batch = repo.jobs.get_job(tenant.id, batch_id)
        content = b"".join(
            piece if isinstance(piece, bytes) else piece.encode()
            for piece in batches.file_content(repo, tenant.id, batch.input_file_id)
        )
        bodies += [json.loads(line)["body"] for line in content.splitlines()]
    assert (
        len(bodies) == repo.summary_jobs.get_summary_job(None, job.id).planned_steps > 4
    )  # map and reduce
    for body in bodies:
        assert {k: body[k] for k in sampling} == sampling


def test_sampling_settings_not_known_refuse_the_create(
    repo: Repository, small_batches: Settings
) -> None:
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest(
        "tiny-model", "Summarise.", SHAPE.summary_tokens, "1h", {"seed": 7}
    )
    with pytest.raises(InvalidRequest, match="'seed' is not known") as refused:
        jobs.create_job(repo, small_batches, tenant, request, SHAPE)
    assert refused.value.param == "sampling"
    assert repo.summary_jobs.list_summary_jobs(tenant.id) == []
