"""The work budget's control step as a node's dispatcher takes it: the signals it measures
from its own attempts, and when a new budget makes room for more.

The controller itself is :func:`backfill.work_budget.step`; what it preempts is chosen by
:func:`backfill.dispatch.stops.ttft_victims`.
"""

from __future__ import annotations

from backfill.dispatch.view import NodeView
from backfill.work_budget import WorkBudget, WorkSignals
from backfill.work_signals import InteractiveSignals

ENGINE_GAUGE_LAG_S = 2.0
"""How stale the engine's ``num_requests_waiting`` may be against this worker's own view of its
batch (one engine step on a loaded CPU, plus the metrics read)."""


def budget_signals(
    view: NodeView,
    interactive: InteractiveSignals,
    *,
    now_s: float,
    engine_waiting: int | None,
    engine_read_at: float,
    other_batch_awaiting: int,
) -> WorkSignals:
    """What the controller measures: the gateways' ``interactive`` signals, the engine's
    queue (read at ``engine_read_at``, monotonic; None: not read), and this worker's batch
    (``view``) beside the node's other workers' (``other_batch_awaiting``). ``now_s`` is on
    the clock the gateways stamp (Redis')."""
    active = view.active
    awaiting = sum(1 for f in active if f.first_token_at is None)
    # The gauge is as old as the engine's last step, and the read itself takes a while:
    # batch whose first token came since may still be counted in it as waiting.
    started_since_read = sum(
        1
        for f in active
        if f.first_token_at is not None and f.first_token_at >= engine_read_at - ENGINE_GAUGE_LAG_S
    )
    return WorkSignals(
        now_s=now_s,
        interactive_waiting=interactive.waiting,
        interactive_prefilling=interactive.prefilling,
        oldest_pending_since_s=interactive.oldest_pending_since_s,
        ttfts=interactive.ttfts,
        engine_waiting=engine_waiting,
        batch_in_flight=len(active),
        batch_awaiting_first_token=awaiting,
        other_batch_awaiting_first_token=other_batch_awaiting,
        batch_started_since_engine_read=started_since_read,
    )


def budget_opened(before: WorkBudget, after: WorkBudget) -> bool:
    """Whether ``after`` lets start what ``before`` did not: a hold lifted, or more
    sequences (the loop then claims at once instead of after its idle poll)."""
    return (before.hold and not after.hold) or after.max_seqs > before.max_seqs
