"""Summarisation jobs in Postgres: the jobs, their documents, the steps each document makes
and the batches that carry them (the only SQL of ``backfill.summarize``).

Each module owns one part, its statements beside the code that runs them:

- ``records``: the values the summary store returns and takes;
- ``jobs``: a job's life (created, read, its documents received with their map steps, moved,
  driven by one process at a time);
- ``batches``: the steps cut into batches, and the batches made;
- ``outcomes``: the reduce driver's harvest of ended steps and the decisions it writes back;
- ``reports``: a job's counts and its documents page by page.

Each of ``jobs``, ``batches``, ``outcomes`` and ``reports`` is a role of
:class:`~backfill.store.Repository` (``repo.summary_jobs``, ``repo.summary_batches``, ...).
"""

from __future__ import annotations

from backfill.store.summaries.batches import SummaryBatches
from backfill.store.summaries.jobs import SummaryJobs
from backfill.store.summaries.outcomes import SummaryOutcomes
from backfill.store.summaries.records import (
    DocumentRow,
    FinishedStep,
    NewDocument,
    NewStep,
    StepBacklog,
    SummaryCounts,
    SummaryJobRecord,
)
from backfill.store.summaries.reports import SummaryReports

__all__ = [
    "DocumentRow",
    "FinishedStep",
    "NewDocument",
    "NewStep",
    "StepBacklog",
    "SummaryBatches",
    "SummaryCounts",
    "SummaryJobRecord",
    "SummaryJobs",
    "SummaryOutcomes",
    "SummaryReports",
]
