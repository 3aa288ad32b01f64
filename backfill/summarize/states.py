"""The states of a summarisation job, of its documents and of its steps (stored as text with
CHECK constraints built from these enums, as ``backfill.states`` does for batches)."""

from __future__ import annotations

from enum import StrEnum


class SummaryJobState(StrEnum):
    RECEIVING = "receiving"
    """Created; its documents are being sent (and split). Nothing runs yet."""
    IN_PROGRESS = "in_progress"
    """Started: admitted on its whole forecast, its steps run in its batches."""
    COMPLETED = "completed"
    """Every document ended (summarised or failed; the results say which)."""
    FAILED = "failed"
    """Refused after its documents came in (its deadline cannot be met, say)."""
    CANCELLING = "cancelling"
    """Cancel was asked; its batches are being cancelled."""
    CANCELLED = "cancelled"
    """Cancelled: its batches cancelled, what was summarised kept."""
    EXPIRED = "expired"
    """Its deadline passed with documents unfinished; what was summarised is kept."""


SUMMARY_JOB_TERMINAL = frozenset(
    {
        SummaryJobState.COMPLETED,
        SummaryJobState.FAILED,
        SummaryJobState.CANCELLED,
        SummaryJobState.EXPIRED,
    }
)
SUMMARY_JOB_TRANSITIONS: dict[SummaryJobState, frozenset[SummaryJobState]] = {
    SummaryJobState.RECEIVING: frozenset(
        {SummaryJobState.IN_PROGRESS, SummaryJobState.FAILED, SummaryJobState.CANCELLED}
    ),
    SummaryJobState.IN_PROGRESS: frozenset(
        {SummaryJobState.COMPLETED, SummaryJobState.CANCELLING, SummaryJobState.EXPIRED}
    ),
    SummaryJobState.CANCELLING: frozenset({SummaryJobState.CANCELLED}),
    **{state: frozenset() for state in SUMMARY_JOB_TERMINAL},
}


def sources_of(target: SummaryJobState) -> frozenset[SummaryJobState]:
    """The states a job may move to ``target`` from (the guard of its UPDATE)."""
    return frozenset(s for s, targets in SUMMARY_JOB_TRANSITIONS.items() if target in targets)


class StepState(StrEnum):
    PENDING = "pending"
    """Created; its item is queued or running in one of the job's batches (or its batch is
    still to be made)."""
    SUCCEEDED = "succeeded"
    """Its item finished with a summary."""
    FAILED = "failed"
    """Its item failed, expired or was cancelled, or its batch ended without it."""


class DocumentState(StrEnum):
    PENDING = "pending"
    """Steps still to run."""
    SUCCEEDED = "succeeded"
    """Summarised: the summary is its root step's."""
    FAILED = "failed"
    """Not summarised: a row error of the source, or a step that failed."""


DOCUMENT_ENDED = frozenset({DocumentState.SUCCEEDED, DocumentState.FAILED})
