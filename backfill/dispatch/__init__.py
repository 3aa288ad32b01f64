"""The node dispatcher's decisions, apart from carrying them out.

As vLLM's scheduler splits ``schedule()`` (a plan over a view of its state) from applying
the plan, a node's dispatcher (``worker.dispatch``) gathers a :class:`NodeView` of what it
holds, asks the plans here what to do, and does it (engine calls, Postgres and ledger
writes). The plans are pure functions over plain values, tested without services:

- :mod:`~backfill.dispatch.claims`: how many attempts may start and how many items to claim;
- :mod:`~backfill.dispatch.checks`: what a claimed item runs, and whether it may (class
  limit, deadline) before any engine work;
- :mod:`~backfill.dispatch.prefix_starts`: which checked items lean on a shared prompt
  prefix, and which wait for its first holder to cache it;
- :mod:`~backfill.dispatch.starts`: which checked items the slack and the work budget take,
  what each reserves, and what the ledger's answer means;
- :mod:`~backfill.dispatch.stops`: which attempts to stop and what stopping one means;
- :mod:`~backfill.dispatch.outcomes`: when a failed attempt is tried again or fails its item;
- :mod:`~backfill.dispatch.budget`: the work budget's signals as a dispatcher measures them.

The simulator (``backfill_analysis.simulate``) enforces the work budget through the same
functions.
"""

from backfill.dispatch.budget import ENGINE_GAUGE_LAG_S, budget_opened, budget_signals
from backfill.dispatch.checks import (
    CheckedItem,
    EngineAbsent,
    Limits,
    RunPlan,
    Verdict,
    fit_output,
    judge,
    over_limit,
    run_output,
    seconds_needed,
)
from backfill.dispatch.claims import claim_size, claims_due, start_room, startable
from backfill.dispatch.outcomes import (
    Expire,
    Fail,
    FailureKind,
    GiveBack,
    backoff_s,
    engine_refusal,
    error_json,
    retry_or_fail,
)
from backfill.dispatch.prefix_starts import (
    FIRST_PREFILL_WAIT_S,
    PREFIX_PASS_HOLD_S,
    PrefixStarts,
    PrefixView,
    plan_prefix_starts,
    prefix_claim_hold_s,
)
from backfill.dispatch.settings import DispatchConfig
from backfill.dispatch.starts import (
    Leased,
    StartPlan,
    after_reserve,
    fit_starts,
    preemptible,
    reserve_request,
)
from backfill.dispatch.stops import (
    StopAction,
    StopReason,
    after_stop,
    heartbeat_stop,
    stalled,
    ttft_victims,
)
from backfill.dispatch.view import BatchLoad, FlightView, NodeView, prefilling, running_mean

__all__ = [
    "ENGINE_GAUGE_LAG_S",
    "FIRST_PREFILL_WAIT_S",
    "PREFIX_PASS_HOLD_S",
    "BatchLoad",
    "CheckedItem",
    "DispatchConfig",
    "EngineAbsent",
    "Expire",
    "Fail",
    "FailureKind",
    "FlightView",
    "GiveBack",
    "Leased",
    "Limits",
    "NodeView",
    "PrefixStarts",
    "PrefixView",
    "RunPlan",
    "StartPlan",
    "StopAction",
    "StopReason",
    "Verdict",
    "after_reserve",
    "after_stop",
    "backoff_s",
    "budget_opened",
    "budget_signals",
    "claim_size",
    "claims_due",
    "engine_refusal",
    "error_json",
    "fit_output",
    "fit_starts",
    "heartbeat_stop",
    "judge",
    "over_limit",
    "plan_prefix_starts",
    "preemptible",
    "prefilling",
    "prefix_claim_hold_s",
    "reserve_request",
    "retry_or_fail",
    "run_output",
    "running_mean",
    "seconds_needed",
    "stalled",
    "start_room",
    "startable",
    "ttft_victims",
]
