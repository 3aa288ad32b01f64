"""A summarisation job driven by the node that runs its items: as the node's results are
stored, the job's driver is woken (``worker.summary_wake``), so its reduce steps are made and
the job ends with no maintenance tick at all (one used to be needed per reduce level, 5 s
apart by default).

Real Postgres and Redis, a real node dispatcher over the stand-in engine.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from backfill.config import Settings
from backfill.engine.protocol import ChoiceDelta, CompletionStream, StreamChunk, Usage
from backfill.store import NewItem, Repository
from backfill.store.summaries import SummaryBatches
from backfill.summarize import driver, jobs
from backfill.summarize.job_plan import BUSY_GAP_FACTOR, JobShape
from backfill.summarize.states import DocumentState, SummaryJobState
from tests.integration.standin_engine import (
    StandInEngine,
    quick_dispatcher,
    run_until,
    stand_in_node,
)
from worker.summary_wake import SummaryWaker

pytestmark = pytest.mark.usefixtures("summary_counts_checked")

NODE = "n-wake"
BLOCK = 16
SHAPE = JobShape(
    context_tokens=400, map_prompt_tokens=20, reduce_prompt_tokens=40, summary_tokens=16
)
LONG = "\n\n".join(
    f"Paragraph {i} of the report. " + "It says a few words. " * 12 for i in range(40)
)


class ChatStandIn(StandInEngine):
    """The stand-in answering a chat request with a one-word summary, as a chat stream."""

    def answer(self, body: Mapping[str, Any]) -> CompletionStream:
        async def chunks() -> AsyncIterator[StreamChunk]:
            choice = {"index": 0, "delta": {"content": "gist"}, "finish_reason": "stop"}
            yield StreamChunk("c", (ChoiceDelta(0, "gist", "stop"),), None, {"choices": [choice]})
            yield StreamChunk("c", (), Usage(5, 1, 6), {"usage": {"prompt_tokens": 5}})

        return CompletionStream(chunks())


def _words(text: str) -> int:
    return 1 + len(text.split()) * 2


def _started_job(repo: Repository, settings: Settings) -> str:
    tenant = repo.tenants.create_tenant("acme")
    request = jobs.SummaryJobRequest("m", "Summarise.", SHAPE.summary_tokens, "1h")
    job = jobs.create_job(repo, settings, tenant, request, SHAPE)
    documents = [jobs.prepare_document(job, "long", LONG, _words)]
    documents += [jobs.prepare_document(job, f"s{i}", f"Note {i}.", _words) for i in range(3)]
    assert len(documents[0].bodies) > SHAPE.fan_in  # two reduce levels above the chunks
    jobs.add_documents(repo, settings, tenant, job, documents)
    jobs.start_job(repo, settings, tenant, repo.summary_jobs.get_summary_job(None, job.id))
    return job.id


def _job_and_its_first_batch(repo: Repository, settings: Settings) -> tuple[str, str]:
    """A started job and the batch of map steps its first round made."""
    job_id = _started_job(repo, settings)
    driver.drive(repo, settings)
    (made,) = repo.summary_batches.summary_batch_ids(job_id)
    return job_id, made


def test_a_job_runs_to_its_end_on_its_nodes_wakes_without_a_tick(settings: Settings) -> None:
    with stand_in_node(settings, NODE, BLOCK, blocks=256) as (repo, _, aledger):
        job_id = _started_job(repo, settings)
        driver.drive(repo, settings)  # the start's round: the map steps' batch
        first = repo.summary_batches.summary_batch_ids(job_id)
        assert len(first) == 1
        waker = SummaryWaker(repo, settings).start()
        dispatcher = quick_dispatcher(
            NODE, ChatStandIn(blocks=256, block=BLOCK), repo, aledger, BLOCK, work_budget=None
        )
        dispatcher.items_ended = waker.items_ended
        try:
            run_until(
                dispatcher,
                aledger,
                lambda: (
                    repo.summary_jobs.get_summary_job(None, job_id).state
                    is SummaryJobState.COMPLETED
                ),
            )
        finally:
            waker.stop()

        job = repo.summary_jobs.get_summary_job(None, job_id)
        assert job.state is SummaryJobState.COMPLETED
        rows = repo.summary_reports.document_page(job_id, -1, 10)
        assert [r.state for r in rows] == [DocumentState.SUCCEEDED] * 4, [r.error for r in rows]
        assert rows[0].split_depth == 2
        assert all(r.summary for r in rows)
        # The reduce levels' batches were made by the wakes (no tick ran after the first).
        assert len(repo.summary_batches.summary_batch_ids(job_id)) == 3
        assert waker.rounds >= 2


def test_only_batches_a_summary_job_made_are_taken_as_its(
    settings: Settings, repo: Repository
) -> None:
    job_id, made = _job_and_its_first_batch(repo, settings)
    # A user's batch may carry any metadata, a summary job's id too: it is not that job's.
    tenant = repo.tenants.create_tenant("mallory")
    f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
    posing = repo.jobs.create_job(
        tenant.id,
        f.id,
        "/v1/chat/completions",
        "1h",
        datetime.now(UTC) + timedelta(hours=1),
        metadata={"summary_job": job_id, "summary_batch": "0"},
    )
    repo.ingest.insert_items(posing.id, [NewItem(0, "x", "{}", 1)])
    assert repo.summary_batches.summary_jobs_of_batches([made, posing.id, "batch_none"]) == {
        made: job_id
    }


class _FailingOnce:
    """The real repository's batches role, whose first lookup of batches' jobs fails as a bug
    would."""

    def __init__(self, batches: SummaryBatches) -> None:
        self._batches, self.lookups = batches, 0

    def summary_jobs_of_batches(self, batch_ids: Sequence[str]) -> dict[str, str]:
        self.lookups += 1
        if self.lookups == 1:
            raise RuntimeError("an unexpected fault")
        return self._batches.summary_jobs_of_batches(batch_ids)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batches, name)


def test_a_round_that_fails_unexpectedly_leaves_the_waker_waking(
    settings: Settings, repo: Repository, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, made = _job_and_its_first_batch(repo, settings)
    failing = _FailingOnce(repo.summary_batches)
    monkeypatch.setattr(repo, "summary_batches", failing)
    waker = SummaryWaker(repo, settings).start()
    try:
        waker.items_ended([made])
        _wait_for(lambda: failing.lookups == 1)
        waker.items_ended([made])  # the next results' wake still drives the job
        _wait_for(lambda: waker.rounds == 1)
    finally:
        waker.stop()
    assert failing.lookups == 2


def _wait_for(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the waker did not get there"
        time.sleep(0.01)


def test_wakes_soon_after_a_round_are_taken_by_one_round_later(
    settings: Settings, repo: Repository
) -> None:
    """Results are stored many times a second while a job's map wave runs: a round right
    after each kept the waker busy on the engine's cores (red before: a round per wake).
    The results stored meanwhile wait for the next round; a stop does not wait for it."""
    _, made = _job_and_its_first_batch(repo, settings)
    waker = SummaryWaker(repo, settings, round_gap_s=60.0).start()
    try:
        waker.items_ended([made])
        _wait_for(lambda: waker.rounds == 1)
        for _ in range(5):
            waker.items_ended([made])
        time.sleep(1.0)  # without the gap a second round comes at once
        assert waker.rounds == 1
    finally:
        waker.stop()
    assert not waker._thread.is_alive()  # the stop ended the gap's wait


def test_a_job_with_many_steps_waiting_to_start_is_woken_less_often(
    settings: Settings, repo: Repository
) -> None:
    """Red before: every round, busy or not, came ``round_gap_s`` after the last (a 2,000-
    document job: ~400 rounds, each reading every ended item of its open batches)."""
    tenant = repo.tenants.create_tenant("busy")
    request = jobs.SummaryJobRequest("m", "Summarise.", SHAPE.summary_tokens, "1h")
    busy = jobs.create_job(repo, settings, tenant, request, SHAPE)
    notes = [jobs.prepare_document(busy, f"n{i}", f"Note {i}.", _words) for i in range(300)]
    jobs.add_documents(repo, settings, tenant, busy, notes)
    jobs.start_job(repo, settings, tenant, repo.summary_jobs.get_summary_job(None, busy.id))
    driver.drive(repo, settings)  # one batch of 300 map steps, none started
    (made,) = repo.summary_batches.summary_batch_ids(busy.id)
    waker = SummaryWaker(repo, settings, round_gap_s=0.05).start()
    try:
        waker.items_ended([made])
        _wait_for(lambda: waker.rounds == 1)
        _wait_for(lambda: waker.last_gap_s == 0.05 * BUSY_GAP_FACTOR)
    finally:
        waker.stop()

    _, few = _job_and_its_first_batch(repo, settings)  # a handful of steps waiting
    waker = SummaryWaker(repo, settings, round_gap_s=0.05).start()
    try:
        waker.items_ended([few])
        _wait_for(lambda: waker.rounds == 1)
        time.sleep(0.1)
        assert waker.last_gap_s == 0.05
    finally:
        waker.stop()
