"""Job and item states, and the one table of transitions between them.

Every write that changes a state is checked against this table by the repository; a
transition not listed here is a bug, not a race, and raises.
"""

from __future__ import annotations

from enum import StrEnum


class ItemState(StrEnum):
    """Where one request line of a batch stands."""

    QUEUED = "queued"
    """Accepted and waiting to be claimed by a worker."""
    DEFERRED = "deferred"
    """Claimed once, but the node had no slack for it; back in the queue until ``not_before``."""
    RESERVED = "reserved"
    """Claimed by a worker attempt that holds or is acquiring a ledger lease; no engine work."""
    RUNNING = "running"
    """Sent to the engine under a lease; its fencing token guards every later write."""
    PREEMPTED = "preempted"
    """Aborted in the engine to make room for interactive work; partial output kept, claimable."""
    SUCCEEDED = "succeeded"
    """Finished with a result."""
    FAILED = "failed"
    """Finished with an error (bad request, engine error, or retry cap reached)."""
    EXPIRED = "expired"
    """Not finished before its deadline; never started once it could not finish in time."""
    CANCELLED = "cancelled"
    """Its job was cancelled before it finished."""


class JobState(StrEnum):
    """A batch's state, as OpenAI's Batch API names them."""

    VALIDATING = "validating"
    """The input file is being checked and its lines turned into items."""
    FAILED = "failed"
    """The input was invalid (``errors`` says why), or no item could succeed."""
    IN_PROGRESS = "in_progress"
    """Items are queued or running."""
    FINALIZING = "finalizing"
    """Every item is terminal; output and error files are being written."""
    COMPLETED = "completed"
    """Done; results are in the output file, failures in the error file."""
    EXPIRED = "expired"
    """The deadline passed; finished results are kept, the rest expired."""
    CANCELLING = "cancelling"
    """Cancel was asked; in-flight items are being stopped."""
    CANCELLED = "cancelled"
    """Cancelled; finished results are kept."""


ITEM_TERMINAL: frozenset[ItemState] = frozenset(
    {ItemState.SUCCEEDED, ItemState.FAILED, ItemState.EXPIRED, ItemState.CANCELLED}
)
"""Item states nothing leaves."""

ITEM_CLAIMABLE: frozenset[ItemState] = frozenset(
    {ItemState.QUEUED, ItemState.DEFERRED, ItemState.PREEMPTED}
)
"""Item states a worker may claim from (subject to ``not_before``)."""

ITEM_ACTIVE: frozenset[ItemState] = frozenset({ItemState.RESERVED, ItemState.RUNNING})
"""Item states held by a worker attempt (and so, possibly, by a ledger lease)."""

JOB_TERMINAL: frozenset[JobState] = frozenset(
    {JobState.COMPLETED, JobState.FAILED, JobState.EXPIRED, JobState.CANCELLED}
)
"""Job states nothing leaves."""

_I = ItemState
ITEM_TRANSITIONS: dict[ItemState, frozenset[ItemState]] = {
    # -> running: claimed and started in one transaction (the worker's path: the item is
    # reserved for it only inside that transaction, ``backfill.store.open_claims``).
    _I.QUEUED: frozenset({_I.RESERVED, _I.RUNNING, _I.EXPIRED, _I.CANCELLED, _I.FAILED}),
    _I.DEFERRED: frozenset({_I.RESERVED, _I.RUNNING, _I.EXPIRED, _I.CANCELLED, _I.FAILED}),
    _I.PREEMPTED: frozenset({_I.RESERVED, _I.RUNNING, _I.EXPIRED, _I.CANCELLED, _I.FAILED}),
    # reserved -> queued: the attempt gave the item back unstarted (graceful stop, or its
    # worker died and the reaper rescued it).
    _I.RESERVED: frozenset(
        {_I.RUNNING, _I.DEFERRED, _I.QUEUED, _I.EXPIRED, _I.CANCELLED, _I.FAILED}
    ),
    # running -> queued: the worker died mid-generation; the reaper requeues it.
    _I.RUNNING: frozenset(
        {_I.SUCCEEDED, _I.FAILED, _I.PREEMPTED, _I.QUEUED, _I.EXPIRED, _I.CANCELLED}
    ),
    _I.SUCCEEDED: frozenset(),
    _I.FAILED: frozenset(),
    _I.EXPIRED: frozenset(),
    _I.CANCELLED: frozenset(),
}

_J = JobState
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    _J.VALIDATING: frozenset({_J.IN_PROGRESS, _J.FAILED, _J.CANCELLING, _J.CANCELLED}),
    _J.IN_PROGRESS: frozenset({_J.FINALIZING, _J.CANCELLING, _J.EXPIRED, _J.FAILED}),
    _J.FINALIZING: frozenset({_J.COMPLETED, _J.FAILED, _J.EXPIRED, _J.CANCELLED}),
    _J.CANCELLING: frozenset({_J.CANCELLED}),
    _J.COMPLETED: frozenset(),
    _J.FAILED: frozenset(),
    _J.EXPIRED: frozenset(),
    _J.CANCELLED: frozenset(),
}


def item_sources(target: ItemState) -> frozenset[ItemState]:
    """The states an item may move to ``target`` from."""
    return frozenset(s for s, nexts in ITEM_TRANSITIONS.items() if target in nexts)


def job_sources(target: JobState) -> frozenset[JobState]:
    """The states a job may move to ``target`` from."""
    return frozenset(s for s, nexts in JOB_TRANSITIONS.items() if target in nexts)


def can_item_move(source: ItemState, target: ItemState) -> bool:
    """Whether the table allows ``source -> target``."""
    return target in ITEM_TRANSITIONS[source]


def can_job_move(source: JobState, target: JobState) -> bool:
    """Whether the table allows ``source -> target``."""
    return target in JOB_TRANSITIONS[source]


FINISH_REASON_STATE: dict[str, ItemState] = {
    # The engine's finish reasons, mapped once (as vLLM's _FINISHED_REASON_MAP does).
    "stop": ItemState.SUCCEEDED,
    "length": ItemState.SUCCEEDED,
    "tool_calls": ItemState.SUCCEEDED,
    "abort": ItemState.PREEMPTED,
    "error": ItemState.FAILED,
}


class AttemptOutcome(StrEnum):
    """How one worker attempt at an item ended."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PREEMPTED = "preempted"
    DEFERRED = "deferred"
    RELEASED = "released"
    """Given back unstarted (graceful stop)."""
    LOST = "lost"
    """Its worker stopped heartbeating; the reaper took the item back."""
    EXPIRED = "expired"
    CANCELLED = "cancelled"
