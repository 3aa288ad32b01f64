"""The reduce driver: the server's side of a running summarisation job, one round at a time.

Each round, for each job in progress (one process at a time per job, under its advisory
lock), it carries out what :mod:`backfill.summarize.decide` and
:mod:`backfill.summarize.job_plan` decide:

1. **harvest**: steps whose items ended get their outcome (summary and usage, or why they
   failed), and their documents are marked for a decision, in one transaction;
2. **decide**: each marked document gets its next reduce steps (their children all
   summarised), or ends with its root's summary or its first failure; the new steps, the
   ends and the unmarking commit together;
3. **batch**: steps no batch carries yet are cut into batch files at the Batch API's limits,
   when they fill a file or the job's queue runs low (``job_plan.cut_now``), numbered, and
   made into batches under the job's deadline (each batch's idempotency key names the job and
   its number, so a batch numbered before a crash is made once);
4. **end**: a job with no document pending, and none to come (its documents closed), is
   completed (expired, if its deadline passed with documents failed).

Every step is keyed by its document and node and every write is guarded, so a driver killed
between any two of these runs again from what is stored: nothing lost, nothing doubled.
It runs beside the other periodic upkeep (``backfill.maintenance.tick``).
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass

from backfill import finalize
from backfill.batch_ingest import Admission, ingest_items
from backfill.batches import INPUT_PURPOSE, upload_file
from backfill.config import Settings
from backfill.errors import BackfillError, Conflict, StaleWrite
from backfill.refusals import Refusal
from backfill.states import JobState
from backfill.store.protocol import SummaryStore
from backfill.store.summaries import DocumentRow, NewStep, SummaryJobRecord
from backfill.summarize.decide import StepView, decide_document
from backfill.summarize.job_plan import BatchCut, cut_now
from backfill.summarize.outcomes import step_outcome
from backfill.summarize.prompts import CHAT_URL, batch_line, reduce_messages, request_body
from backfill.summarize.states import DocumentState, StepState, SummaryJobState
from backfill.windows import DeadlinePlan, batch_throughput

log = logging.getLogger("backfill.summarize")

HARVEST_PAGE = 2000
DECIDE_PAGE = 500
MAX_ROUND_STEPS = 200_000
"""Steps one round cuts into batches at most (the rest wait for the next round)."""
START_ROUND_STEPS = 2_000
"""Steps the start's own round cuts at most: enough to keep an engine busy until the next
round, little enough that the start answers in well under a second."""


@dataclass(slots=True)
class DriverReport:
    harvested: int = 0
    decided: int = 0
    reduce_steps: int = 0
    batches: int = 0
    documents_ended: int = 0
    jobs_ended: int = 0
    waiting_steps: int | None = None
    """Of the last job driven, its steps in batches no engine has started (None: not read)."""

    def writes(self) -> tuple[int, ...]:
        """What the rounds so far wrote: a change says a round moved a step or a document."""
        return (
            self.harvested,
            self.decided,
            self.reduce_steps,
            self.batches,
            self.documents_ended,
            self.jobs_ended,
        )


def drive(repo: SummaryStore, settings: Settings, limit: int = 100) -> DriverReport:
    """One round over the open summarisation jobs."""
    report = DriverReport()
    for job_id in repo.summary_jobs.open_summary_jobs(limit):
        with repo.summary_jobs.driver_lock(job_id) as held:
            if not held:
                continue  # another process drives it this round
            try:
                drive_job(repo, settings, job_id, report)
            except BackfillError as exc:  # Postgres went away, say: next round
                log.warning("summary job %s not driven this round: %s", job_id, exc)
    return report


def drive_now(
    repo: SummaryStore,
    settings: Settings,
    job_id: str,
    max_steps: int = MAX_ROUND_STEPS,
    report: DriverReport | None = None,
) -> bool:
    """One round of one job now, not at the next tick (its start made, its items ended),
    cutting at most ``max_steps`` steps into batches: whether it ran (False: another process
    holds the job's lock and drives it)."""
    with repo.summary_jobs.driver_lock(job_id) as held:
        if held:
            drive_job(repo, settings, job_id, report, max_steps=max_steps)
        return held


def batch_now(
    repo: SummaryStore, settings: Settings, job_id: str, max_steps: int = START_ROUND_STEPS
) -> bool:
    """Cut the job's new steps into batches now (at most ``max_steps``), and nothing else of a
    round: what a documents request does for a job that runs, so the request waits on its own
    documents' batch, never on a round's harvest of everything that ended meanwhile (the
    node's wakes and the tick do that). Whether it ran (False: another process drives it)."""
    with repo.summary_jobs.driver_lock(job_id) as held:
        if held:
            job = repo.summary_jobs.get_summary_job(None, job_id)
            running = job.state is SummaryJobState.IN_PROGRESS
            if running and job.deadline is not None and repo.now() < job.deadline:
                make_batches(repo, settings, job, max_steps)
        return held


def drive_job(
    repo: SummaryStore,
    settings: Settings,
    job_id: str,
    report: DriverReport | None = None,
    *,
    max_steps: int = MAX_ROUND_STEPS,
) -> None:
    report = report if report is not None else DriverReport()
    before = report.writes()
    job = repo.summary_jobs.get_summary_job(None, job_id)
    if job.state is SummaryJobState.CANCELLING:
        _cancel(repo, job)
        report.jobs_ended += 1
    elif job.state is SummaryJobState.IN_PROGRESS:
        _drive_running(repo, settings, job, report, max_steps)
    else:
        return
    if report.writes() != before:
        # What the round changed of the job's counts, folded: a status read sums a row per
        # state, not one per statement since the job began (a round that wrote nothing
        # added no row to fold).
        repo.summary_reports.fold_counts(job.id)


def _drive_running(
    repo: SummaryStore,
    settings: Settings,
    job: SummaryJobRecord,
    report: DriverReport,
    max_steps: int,
) -> None:
    report.harvested += harvest(repo, job)
    _decide(repo, job, report)
    if job.deadline is not None and repo.now() >= job.deadline:
        # Past its deadline no batch of it is made: the steps without one fail as expired.
        if repo.summary_outcomes.fail_unmade_steps(
            job.id, "expired: the job's deadline passed before it ran"
        ):
            _decide(repo, job, report)
    else:
        report.batches += make_batches(repo, settings, job, max_steps, report)
    if _end_if_done(repo, job):
        report.jobs_ended += 1


def _decide(repo: SummaryStore, job: SummaryJobRecord, report: DriverReport) -> None:
    decided, created, ended = decide(repo, job)
    report.decided += decided
    report.reduce_steps += created
    report.documents_ended += ended


def harvest(repo: SummaryStore, job: SummaryJobRecord) -> int:
    """Steps whose items ended, with their outcomes; returns how many. A round reads what
    ended since the last (and every minute, everything: ``SummaryOutcomes.harvest_read``)."""
    read = repo.summary_outcomes.harvest_read(job.id)
    total = 0
    while True:
        rows = repo.summary_outcomes.finished_steps(job.id, HARVEST_PAGE, read.since)
        outcomes: dict[tuple[int, int], StepView] = {}
        for row in rows:
            view = (
                step_outcome(row.item_state, row.result, row.error)
                if row.item_state is not None
                else StepView(StepState.FAILED, error=f"its batch ended {row.batch_state}")
            )
            if view is not None:
                outcomes[(row.seq, row.node)] = view
        repo.summary_outcomes.end_steps(job.id, outcomes)
        total += len(outcomes)
        if len(rows) < HARVEST_PAGE:
            repo.summary_outcomes.mark_harvested(job.id, read)
            return total


def decide(repo: SummaryStore, job: SummaryJobRecord) -> tuple[int, int, int]:
    """Decisions for the documents a step of which ended: (documents decided, reduce steps
    made, documents ended)."""
    decided = created = ended_count = 0
    while True:
        touched = repo.summary_outcomes.touched_documents(job.id, DECIDE_PAGE)
        if not touched:
            return decided, created, ended_count
        steps = repo.summary_outcomes.steps_of(job.id, [seq for seq, _ in touched])
        new_steps: dict[int, list[NewStep]] = {}
        ended: dict[int, DocumentRow] = {}
        for seq, chunks in touched:
            decision = decide_document(chunks, job.fan_in, steps[seq])
            if decision.ended is not None:
                ended[seq] = DocumentRow(
                    seq,
                    None,
                    decision.ended,
                    chunks,
                    decision.split_depth,
                    decision.summary,
                    decision.error,
                    decision.prompt_tokens,
                    decision.completion_tokens,
                )
                continue
            new_steps[seq] = [
                NewStep(
                    new.step.node,
                    request_body(
                        job.model,
                        reduce_messages(job.instruction, new.summaries),
                        job.shape.summary_tokens,
                        job.sampling,
                    ),
                )
                for new in decision.create
            ]
        repo.summary_outcomes.decide_documents(job.id, new_steps, ended)
        decided += len(touched)
        created += sum(len(s) for s in new_steps.values())
        ended_count += len(ended)


def make_batches(
    repo: SummaryStore,
    settings: Settings,
    job: SummaryJobRecord,
    max_steps: int = MAX_ROUND_STEPS,
    report: DriverReport | None = None,
) -> int:
    """Cut the steps no batch carries (at most ``max_steps``) into numbered batches when the
    job's queue runs low (:func:`~backfill.summarize.job_plan.cut_now`), then make every
    numbered batch not made yet; returns how many were made."""
    cut_steps = 0
    backlog = repo.summary_batches.step_backlog(job.id)
    if report is not None:
        report.waiting_steps = backlog.waiting
    if not cut_now(backlog.unbatched, backlog.waiting, settings.max_lines_per_batch):
        max_steps = 0
    while cut_steps < max_steps:
        steps = repo.summary_batches.unbatched_steps(
            job.id, min(settings.max_lines_per_batch, max_steps - cut_steps)
        )
        if not steps:
            break
        cut = BatchCut(settings.max_lines_per_batch, settings.max_file_bytes)
        taken: list[tuple[int, int]] = []
        for seq, node, size in steps:
            if cut.starts_new_file(size):
                break
            taken.append((seq, node))
        repo.summary_batches.number_batch(job.id, taken)
        cut_steps += len(taken)
    made = 0
    for batch_no in repo.summary_batches.batches_to_make(job.id):
        try:
            make_batch(repo, settings, job, batch_no)
        except Refusal as refusal:  # a storage cap: the steps wait for room
            log.warning("summary job %s batch %d not made: %s", job.id, batch_no, refusal)
            break
        made += 1
    return made


class _LinesReader(io.RawIOBase):
    """A binary file over an iterator of lines, read once as an upload is."""

    def __init__(self, lines: Iterator[bytes]) -> None:
        self._lines = lines
        self._rest = b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        while not self._rest:
            try:
                self._rest = next(self._lines)
            except StopIteration:
                return 0
        size = min(len(buffer), len(self._rest))
        buffer[:size] = self._rest[:size]
        self._rest = self._rest[size:]
        return size


def batch_key(job_id: str, batch_no: int) -> str:
    return f"{job_id}:batch:{batch_no}"


def make_batch(repo: SummaryStore, settings: Settings, job: SummaryJobRecord, batch_no: int) -> str:
    """Make the job's batch ``batch_no`` (once: a batch made before under its key is taken
    as it is); returns its id."""
    assert job.deadline is not None, "a job in progress has a deadline"
    tenant = repo.tenants.tenant_by_id(job.tenant_id)
    key = batch_key(job.id, batch_no)
    existing = repo.jobs.job_id_for_idempotency_key(tenant.id, key)
    if existing is not None:
        # Made before the driver stopped: its items may still be to store.
        batch = repo.jobs.get_job(tenant.id, existing)
        record = repo.files.get_file(tenant.id, batch.input_file_id)
    else:
        lines = (
            batch_line(seq, node, body)
            for seq, node, body in repo.summary_batches.batch_steps(job.id, batch_no)
        )
        record = upload_file(
            repo,
            settings,
            tenant.id,
            filename=f"{job.id}-{batch_no}.jsonl",
            purpose=INPUT_PURPOSE,
            content=io.BufferedReader(_LinesReader(lines)),
        )
        batch = repo.jobs.create_job(
            tenant.id,
            record.id,
            CHAT_URL,
            job.completion_window,
            job.deadline,
            metadata={"summary_job": job.id, "summary_batch": str(batch_no)},
            idempotency_key=key,
            model=job.model,
        )
    if batch.state is JobState.VALIDATING and batch.input_file_id == record.id:
        # The job was admitted on its whole forecast at its start; its batches run under its
        # deadline without being judged again one by one.
        now = repo.now()
        window_s = max(1, int((job.deadline - now).total_seconds()))
        admission = Admission(
            forecast=record.tokens_bound or 0,
            now=now,
            window_s=window_s,
            throughput_tps=batch_throughput(settings.batch_throughput_tokens_per_s),
            completion_window=job.completion_window,
        )
        plan = DeadlinePlan(True, job.deadline, now, window_s)
        with contextlib.suppress(Conflict):
            ingest_items(repo, settings, tenant, batch, admission, plan)
    repo.summary_batches.set_batch(job.id, batch_no, batch.id)
    return batch.id


def _end_if_done(repo: SummaryStore, job: SummaryJobRecord) -> bool:
    late = job.deadline is not None and repo.now() >= job.deadline
    if job.documents_open and not late:
        return False  # more documents may come: it ends once closed
    if repo.summary_reports.has_pending_documents(job.id):  # one index probe, not the job's counts
        return False
    counts = repo.summary_reports.summary_counts(job.id)
    if counts.documents.get(DocumentState.PENDING, 0):
        return False
    failed = counts.documents.get(DocumentState.FAILED, 0)
    target = SummaryJobState.EXPIRED if late and failed else SummaryJobState.COMPLETED
    with contextlib.suppress(StaleWrite):
        repo.summary_jobs.move_summary_job(job.id, target)
        return True
    return False


def _cancel(repo: SummaryStore, job: SummaryJobRecord) -> None:
    """Cancel the job's batches, fail what is pending, and end it cancelled."""
    for batch_id in repo.summary_batches.summary_batch_ids(job.id):
        with contextlib.suppress(Conflict, StaleWrite):
            finalize.cancel_job(repo, job.tenant_id, batch_id)
    repo.summary_outcomes.fail_pending_documents(job.id, "cancelled")
    with contextlib.suppress(StaleWrite):
        repo.summary_jobs.move_summary_job(job.id, SummaryJobState.CANCELLED)
