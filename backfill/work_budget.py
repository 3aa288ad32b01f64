"""The batch *work* budget of one node: pure values and pure functions, no I/O.

KV slack (``backfill.policy``) bounds what batch may *store*; it says nothing about the compute
batch takes from every engine step. On these engines batch prefill and decode share each step
with interactive work, and that alone raised interactive time to first token 1.7x with KV to
spare (the peer runs in ``bench/RESULTS.md``). So batch also gets a work budget per node:

    max_seqs            batch sequences in flight at most
    max_prefill_tokens  batch prompt tokens in prefill at once at most (an item is in prefill
                        from its start until its first token arrives)
    hold                no new batch prefill starts at all

A controller moves the budget from measured signals, like TCP's AIMD, and judges each signal
by whether *batch* is what hurts interactive:

- it halves (``decrease_factor``, at most once per ``decrease_interval_s``) and holds new batch
  prefills when interactive requests wait at the gateway for room, when they wait in the
  engine's queue while batch prefills are under way, or when a measured TTFT comes near the
  target;
- an interactive request queued behind *another interactive* prefill is not batch's doing:
  the budget keeps its size, and new batch prefills are held only while a recent shrink says
  batch was hurting (``quiet_s`` after it), so a steady interactive stream does not starve
  batch on its own;
- it grows by a fixed step each control step once ``quiet_s`` has passed since the last
  shrink signal, whether or not interactive requests are active: growth follows the TTFT
  signal, not the absence of traffic.

When an interactive request that has no first token yet has already used
``preempt_at_fraction`` of its TTFT target, waiting for batch to drain would miss the target:
the decision then names the batch prefills under way to preempt (they delay its prefill most
and lose no output), and, once the target itself is spent, any batch over the shrunken budget
too (the caller acts, choosing victims with :func:`budget_victims`).

:func:`step` returns a :class:`BudgetStep` (the new budget, what to preempt, and why);
:func:`admissible` says how many candidate prefills the budget lets start. The worker's
dispatcher and the simulator (``backfill_analysis.simulate``) run these same functions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import TypeVar

from backfill.policy import ServiceClass, VictimCandidate, victim_order_key


class BudgetReason(StrEnum):
    """Why the budget is what it is (the cause of its last change, or of a hold)."""

    START = "start"
    """No signal seen yet: the budget starts at its ceiling (batch alone is the usual case)."""
    INTERACTIVE_WAITING = "interactive_waiting"
    """Interactive requests wait for admission, or in the engine's queue while batch prefills
    are under way: shrink and hold."""
    INTERACTIVE_PREFILL = "interactive_prefill"
    """Interactive requests are in prefill or queued behind each other, with their TTFTs on
    target: keep the budget (hold new batch prefills only within ``quiet_s`` of a shrink)."""
    TTFT_NEAR_TARGET = "ttft_near_target"
    """A recent interactive TTFT came within ``ttft_high_fraction`` of the target: shrink."""
    TTFT_AT_RISK = "ttft_at_risk"
    """An interactive request would miss its TTFT target behind batch work: shrink, hold and
    preempt running batch."""
    QUIET = "quiet"
    """No shrink signal for ``quiet_s``: grow by one step."""
    STEADY = "steady"
    """Nothing to change (no shrink signal, but not yet for long enough; or already at the
    ceiling)."""


PRESSURE: frozenset[BudgetReason] = frozenset(
    {
        BudgetReason.INTERACTIVE_WAITING,
        BudgetReason.TTFT_NEAR_TARGET,
        BudgetReason.TTFT_AT_RISK,
    }
)
"""Reasons that mean batch hurts interactive: growth waits for ``quiet_s`` after the last, and
new batch prefills are held meanwhile while any interactive request is pending."""


@dataclass(frozen=True)
class WorkBudgetPolicy:
    """How a node's batch work budget moves (settings: ``BACKFILL_WORK_BUDGET_*`` and
    ``BACKFILL_INTERACTIVE_TTFT_TARGET_S``)."""

    ttft_target_s: float = 1.0
    """Interactive time to first token the budget protects (the interactive class's target;
    batch has deadlines, not a TTFT target)."""
    floor_seqs: int = 1
    ceiling_seqs: int = 128
    floor_prefill_tokens: int = 512
    ceiling_prefill_tokens: int = 16_384
    decrease_factor: float = 0.5
    """Multiplicative decrease on pressure (the MD of AIMD)."""
    increase_seqs: int = 8
    """Additive increase per quiet step (the AI of AIMD)."""
    increase_prefill_tokens: int = 2048
    quiet_s: float = 2.0
    """How long after the last shrink signal the budget starts growing again (and until when
    new batch prefills are held while interactive requests are pending)."""
    decrease_interval_s: float = 0.5
    """At most one decrease per interval: a signal that persists across a few control steps
    (the engine has not drained yet) is one congestion event, not several."""
    ttft_high_fraction: float = 0.8
    """A measured TTFT above this fraction of the target counts as pressure."""
    preempt_at_fraction: float = 0.5
    """A pending interactive request older than this fraction of the target is at risk: what
    is left of the target is about what its own prefill needs."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ttft_target_s) and self.ttft_target_s > 0):
            raise ValueError("ttft_target_s must be a positive number of seconds")
        if not 1 <= self.floor_seqs <= self.ceiling_seqs:
            raise ValueError("need 1 <= floor_seqs <= ceiling_seqs")
        if not 1 <= self.floor_prefill_tokens <= self.ceiling_prefill_tokens:
            raise ValueError("need 1 <= floor_prefill_tokens <= ceiling_prefill_tokens")
        if not 0 < self.decrease_factor < 1:
            raise ValueError("decrease_factor must be in (0, 1)")
        if self.increase_seqs < 1 or self.increase_prefill_tokens < 1:
            raise ValueError("increase steps must be >= 1")
        if self.quiet_s < 0 or self.decrease_interval_s < 0:
            raise ValueError("quiet_s and decrease_interval_s must be >= 0")
        if not 0 < self.ttft_high_fraction <= 1 or not 0 < self.preempt_at_fraction <= 1:
            raise ValueError("ttft_high_fraction and preempt_at_fraction must be in (0, 1]")


@dataclass(frozen=True)
class WorkSignals:
    """What the controller measures at one instant (one node).

    Times are seconds on one clock shared with :class:`WorkBudget` (Redis' clock in the
    worker, ``backfill.clock.SharedClock``, because the gateways' timestamps come from other
    hosts; simulated time in the simulator).
    """

    now_s: float
    interactive_waiting: int = 0
    """Interactive requests waiting at the gateway for admission to this node."""
    interactive_prefilling: int = 0
    """Interactive requests admitted to this node that have no first token yet."""
    oldest_pending_since_s: float | None = None
    """Arrival of the oldest interactive request without a first token (waiting or
    prefilling); None when there is none."""
    ttfts: tuple[tuple[float, float], ...] = ()
    """Recent interactive ``(first token at, TTFT seconds)``; only those after the budget's
    ``ttft_seen_s`` are new."""
    engine_waiting: int | None = None
    """The engine's ``vllm:num_requests_waiting``; None when it could not be read."""
    batch_in_flight: int = 0
    batch_awaiting_first_token: int = 0
    """This worker's batch sequences with no first token yet (waiting or prefilling in the
    engine): the engine's waiting queue holds at most these of its batch."""
    other_batch_awaiting_first_token: int = 0
    """The same for the node's other workers (they share the engine and its queue)."""
    batch_started_since_engine_read: int = 0
    """This worker's batch sequences whose first token came while (or shortly before)
    ``engine_waiting`` was read: the gauge may still count them as waiting, though they no
    longer count as awaiting a first token."""

    @property
    def node_batch_awaiting_first_token(self) -> int:
        return self.batch_awaiting_first_token + self.other_batch_awaiting_first_token

    @property
    def engine_other_waiting(self) -> int:
        """Engine-queued requests that cannot be batch's (any worker's): interactive traffic,
        including any that bypassed the gateway. Batch that got its first token since the
        gauge was read is batch's too: read as interactive, it shrank and held the budget in
        batch alone (``2 in the engine's queue beside 21 batch prefill(s)`` with no
        interactive traffic at all)."""
        if self.engine_waiting is None:
            return 0
        batch = self.node_batch_awaiting_first_token + self.batch_started_since_engine_read
        return max(0, self.engine_waiting - batch)

    @property
    def oldest_pending_s(self) -> float:
        if self.oldest_pending_since_s is None:
            return 0.0
        return max(0.0, self.now_s - self.oldest_pending_since_s)


@dataclass(frozen=True)
class WorkBudget:
    """One node's batch work budget now, and why it last changed."""

    max_seqs: int
    max_prefill_tokens: int
    hold: bool = False
    """No new batch prefill may start (interactive waits or prefills)."""
    code: BudgetReason = BudgetReason.START
    """Why the budget last changed."""
    reason: str = "no signal yet: the budget starts at its ceiling"
    changed_at_s: float = 0.0
    last_pressure_s: float | None = None
    """When batch was last seen hurting interactive (growth waits ``quiet_s`` after it)."""
    last_decrease_s: float | None = None
    ttft_seen_s: float = -math.inf
    """The newest TTFT already taken into account."""

    @classmethod
    def initial(cls, policy: WorkBudgetPolicy, now_s: float = 0.0) -> WorkBudget:
        return cls(policy.ceiling_seqs, policy.ceiling_prefill_tokens, changed_at_s=now_s)


@dataclass(frozen=True)
class BudgetStep:
    """One control step: the budget to apply, what to preempt, and why."""

    budget: WorkBudget
    code: BudgetReason
    """Why this step decided what it did (``budget.code`` keeps the last *change*)."""
    reason: str
    changed: bool
    """Whether ``max_seqs`` or ``max_prefill_tokens`` moved."""
    preempt: int = 0
    """Running batch sequences to preempt now (0: none)."""


def _shrink(value: int, factor: float, floor: int) -> int:
    return max(floor, min(value - 1, math.floor(value * factor))) if value > floor else floor


@dataclass(frozen=True, slots=True)
class _Pressure:
    """What the signals say of interactive work, before the budget is resized."""

    code: BudgetReason
    why: str
    shrink: bool
    """Batch is what delays interactive work: the budget shrinks."""
    hold: bool
    """New batch prefills wait."""
    oldest_s: float
    """How long the oldest interactive request still pending has waited (0: none)."""
    ttft_seen_s: float


def _pressure(budget: WorkBudget, signals: WorkSignals, policy: WorkBudgetPolicy) -> _Pressure:
    """Classify ``signals``: the most urgent reason first (a TTFT at risk, interactive
    requests waiting, a TTFT near its target, interactive prefills), else quiet."""
    now = signals.now_s
    target = policy.ttft_target_s
    new_ttfts = [(at, t) for at, t in signals.ttfts if at > budget.ttft_seen_s]
    seen = max([budget.ttft_seen_s, *(at for at, _ in new_ttfts)])
    worst_new = max((t for _, t in new_ttfts), default=0.0)
    engine_queued = signals.engine_other_waiting
    pending = signals.interactive_waiting + signals.interactive_prefilling + engine_queued
    oldest = signals.oldest_pending_s if pending else 0.0
    batch_prefills = signals.node_batch_awaiting_first_token
    recently_hurt = (
        budget.last_pressure_s is not None and now - budget.last_pressure_s < policy.quiet_s
    )

    code: BudgetReason
    shrink = hold = False
    if pending and oldest >= policy.preempt_at_fraction * target and signals.batch_in_flight:
        code, shrink, hold = BudgetReason.TTFT_AT_RISK, True, True
        why = (
            f"an interactive request has waited {oldest:.2f} s for its first token, "
            f"{policy.preempt_at_fraction:.0%} of the {target:g} s target"
        )
    elif signals.interactive_waiting or (engine_queued and batch_prefills):
        code, shrink, hold = BudgetReason.INTERACTIVE_WAITING, True, True
        why = (
            f"{signals.interactive_waiting} interactive request(s) wait for admission and "
            f"{engine_queued} in the engine's queue"
            + (f" beside {batch_prefills} batch prefill(s)" if engine_queued else "")
        )
    elif worst_new > policy.ttft_high_fraction * target:
        code, shrink, hold = BudgetReason.TTFT_NEAR_TARGET, True, bool(pending)
        why = (
            f"interactive TTFT of {worst_new:.2f} s is over {policy.ttft_high_fraction:.0%} "
            f"of the {target:g} s target"
        )
    elif pending:
        # Interactive is busy but batch is not what delays it: its TTFTs are on target and
        # whatever waits in the engine waits behind interactive prefills. Batch keeps going
        # within its budget; new prefills stay held only while a recent shrink stands.
        code, hold = BudgetReason.INTERACTIVE_PREFILL, recently_hurt
        why = (
            f"{signals.interactive_prefilling} interactive request(s) in prefill and "
            f"{engine_queued} queued behind them, TTFT on target"
            + (" (new batch prefills held after a recent shrink)" if hold else "")
        )
    else:
        code = BudgetReason.QUIET
        why = "interactive is quiet"
    return _Pressure(code, why, shrink, hold, oldest, seen)


def step(budget: WorkBudget, signals: WorkSignals, policy: WorkBudgetPolicy) -> BudgetStep:
    """The next budget for ``signals``; pure (the caller keeps the returned budget)."""
    now = signals.now_s
    target = policy.ttft_target_s
    pressure = _pressure(budget, signals, policy)
    code, why, shrink, hold = pressure.code, pressure.why, pressure.shrink, pressure.hold
    oldest, seen = pressure.oldest_s, pressure.ttft_seen_s

    last_pressure = now if code in PRESSURE else budget.last_pressure_s
    seqs, prefill = budget.max_seqs, budget.max_prefill_tokens
    last_decrease = budget.last_decrease_s
    grew = False
    if shrink:
        if last_decrease is None or now - last_decrease >= policy.decrease_interval_s:
            seqs = _shrink(seqs, policy.decrease_factor, policy.floor_seqs)
            prefill = _shrink(prefill, policy.decrease_factor, policy.floor_prefill_tokens)
            last_decrease = now
    else:
        calm_for = math.inf if last_pressure is None else now - last_pressure
        if calm_for >= policy.quiet_s:
            seqs = min(policy.ceiling_seqs, seqs + policy.increase_seqs)
            prefill = min(policy.ceiling_prefill_tokens, prefill + policy.increase_prefill_tokens)
            grew = (seqs, prefill) != (budget.max_seqs, budget.max_prefill_tokens)
            if grew:
                what = "interactive quiet" if code is BudgetReason.QUIET else why
                calm = "ever" if math.isinf(calm_for) else f"{calm_for:.1f} s"
                why = f"{what}; no shrink signal for {calm}"
        elif code is BudgetReason.QUIET:
            code = BudgetReason.STEADY
            why = (
                f"interactive quiet; {calm_for:.1f} s since the last shrink signal of the "
                f"{policy.quiet_s:g} s needed"
            )

    changed = (seqs, prefill) != (budget.max_seqs, budget.max_prefill_tokens)
    if changed:
        verb = "grew" if grew else "shrank"
        change = (
            f"{verb} to {seqs} sequences / {prefill} prefill tokens "
            f"(from {budget.max_seqs} / {budget.max_prefill_tokens})"
        )
        reason = f"{change}: {why}"
    else:
        reason = why
    if code is BudgetReason.QUIET and not changed:
        code = BudgetReason.STEADY
    preempt = 0
    if code is BudgetReason.TTFT_AT_RISK:
        # Every batch prefill still going: a prefill chunk is exactly what delays the
        # interactive request's, and aborting one loses no output. Decoding batch over the
        # shrunken budget only once the target itself is spent: a decode token adds little to
        # a step, and aborting one throws its prefill away.
        over = signals.batch_in_flight - seqs if oldest >= target else 0
        preempt = max(over, signals.batch_awaiting_first_token, 0)
        if preempt:
            reason = f"{reason}; preempting {preempt} batch sequence(s)"
    new_budget = WorkBudget(
        max_seqs=seqs,
        max_prefill_tokens=prefill,
        hold=hold,
        code=code if changed else budget.code,
        reason=reason if changed else budget.reason,
        changed_at_s=now if changed else budget.changed_at_s,
        last_pressure_s=last_pressure,
        last_decrease_s=last_decrease,
        ttft_seen_s=seen,
    )
    return BudgetStep(new_budget, code, reason, changed, preempt)


def admissible(
    budget: WorkBudget,
    in_flight: int,
    prefill_tokens: int,
    candidates: Iterable[int],
) -> int:
    """How many of ``candidates`` (their prompt tokens, in start order) may start now.

    A start must keep batch within ``max_seqs`` and within ``max_prefill_tokens`` of prompt
    tokens in prefill. One prompt larger than the whole prefill budget may still start when no
    batch prefill is under way, or it could never run.
    """
    if budget.hold:
        return 0
    count = 0
    for prompt in candidates:
        if in_flight + count >= budget.max_seqs:
            break
        if prefill_tokens + prompt > budget.max_prefill_tokens and prefill_tokens > 0:
            break
        count += 1
        prefill_tokens += prompt
    return count


V = TypeVar("V", bound=VictimCandidate)


def budget_victims(leases: Iterable[V], count: int) -> tuple[V, ...]:
    """Up to ``count`` preemptible batch leases to preempt for a :class:`BudgetStep`, in
    :func:`backfill.policy.victim_order_key` order: least output lost first (prefills lose
    none), then the latest deadline, then the most recently started."""
    if count <= 0:
        return ()
    pool = sorted(
        (x for x in leases if x.service_class is ServiceClass.BATCH and x.preemptible),
        key=victim_order_key,
    )
    return tuple(pool[:count])


def describe(budget: WorkBudget) -> str:
    hold = ", new prefills held" if budget.hold else ""
    return (
        f"{budget.max_seqs} sequences / {budget.max_prefill_tokens} prefill tokens{hold} "
        f"({budget.code}: {budget.reason})"
    )
