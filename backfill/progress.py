"""How far a job has got, and when it should be done: a pure function of its counters.

The ETA prefers what the job itself has shown (finished items per second since it started);
before any item finishes it falls back to the job's remaining declared tokens at the batch
throughput, which is a lower bound (work queued ahead of it is not counted there).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from backfill.states import ItemState, JobState
from backfill.store import JobRecord


@dataclass(frozen=True, slots=True)
class Progress:
    items: dict[str, int]
    """Items per state (every state, zeros included)."""
    total: int
    finished: int
    output_tokens_done: int
    """Output tokens generated so far."""
    output_tokens_max: int
    """Output tokens declared (the sum of ``max_tokens``): the worst case reserved."""
    prompt_tokens: int
    """Prompt tokens counted so far by the workers' tokenizers."""
    eta: datetime | None
    eta_basis: str | None
    """``"observed"`` (the job's own rate) or ``"forecast"`` (declared tokens/throughput)."""
    deadline: datetime
    at_risk: bool
    """The ETA is past the deadline."""


def job_progress(job: JobRecord, now: datetime, throughput_tps: float) -> Progress:
    counts = job.counts
    items = {s.value: counts.count(s) for s in ItemState}
    eta: datetime | None = None
    basis: str | None = None
    if job.state in (JobState.IN_PROGRESS, JobState.CANCELLING) and counts.unfinished:
        started = job.timestamps.get("in_progress_at")
        elapsed = (now - started).total_seconds() if started else 0.0
        if counts.finished and elapsed > 0:
            eta = now + timedelta(seconds=counts.unfinished * elapsed / counts.finished)
            basis = "observed"
        elif counts.total:
            share = counts.unfinished / counts.total
            remaining = int(counts.prompt_tokens + counts.max_output_tokens) * share
            eta = now + timedelta(seconds=remaining / throughput_tps)
            basis = "forecast"
    return Progress(
        items=items,
        total=counts.total,
        finished=counts.finished,
        output_tokens_done=int(counts.output_tokens),
        output_tokens_max=int(counts.max_output_tokens),
        prompt_tokens=int(counts.prompt_tokens),
        eta=eta,
        eta_basis=basis,
        deadline=job.deadline,
        at_risk=eta is not None and eta > job.deadline,
    )
