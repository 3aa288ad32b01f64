"""The step scheduler's per-step decision, as pure functions over a view of the engine's queues.

Every step, before vLLM's own scheduler runs, :func:`plan_step` decides from a
:class:`StepView`:

- *holding*: while any interactive request waits or still has prompt tokens to prefill, batch
  yields the step. Its resident sequences are **paused**: they keep their KV blocks, slot and
  computed tokens and carry no tokens (nothing aborted, nothing recomputed), and no waiting
  batch request is admitted;
- *relief*: a paused sequence at its starvation bound (``starvation_steps`` steps or
  ``starvation_s`` seconds without progress) carries tokens in this step anyway; a waiting
  (or preempted) batch request at the same bound in seconds is admitted anyway, so a
  sustained interactive load never holds batch back without bound;
- *ride-along*: with ``ride_along_share`` > 0, batch decoders carry tokens in a holding step up
  to that share of the step's own time, priced by the fitted step-time model;
- the *whole-step bound*: while interactive work is in the engine or was within
  ``interactive_likely_s``, batch decodes and prefill together add at most ``chunk_target_s``
  to a step by the fitted model (half for a step scheduled ahead under async scheduling, where
  an arrival waits for the step in flight and that one); batch decodes take turns when they
  alone would pass it, the longest without progress first;
- *held back*: under async scheduling, while interactive work is likely but none is in the
  engine, a step that would carry batch alone is not scheduled ahead of the one in flight
  (unless ``ahead_while_likely``): the plan empties it, vLLM's engine loop waits for the step
  in flight, and an arrival meanwhile is in the next step instead of behind one more batch
  step;
- *idle-ready*: while interactive work is in the engine and for ``idle_ready_s`` after, batch
  sits out every step (paused, none admitted, the starvation bound still holding): the engine
  runs interactive work alone or idles, and the next arrival of a burst starts at once instead
  of waiting for a step in flight, whose fixed cost no cap on batch tokens shortens; batch
  makes up for it past the window, best with the cap lifted there (``lift_cap_after_s``);
- the *chunk cap*: batch prefill tokens per step, all batch sequences together, sized from the
  model so the step stays within ``chunk_target_s`` of batch prefill: an interactive request
  arriving mid-step waits at most one short step; lifted once no interactive request has been
  in the engine for ``lift_cap_after_s`` (to vLLM's own token budget, or as far as
  ``lift_fixed_share`` or ``lifted_step_target_s`` bound it), so batch alone loses little to a
  cap that protects nobody and the first interactive request after the quiet spell waits for
  one such step.

:func:`slot_victims` and :func:`kv_victims` choose which running batch sequences to preempt
when interactive work waits for a sequence slot or for KV blocks: vLLM's priority policy
preempts only for a *running* request's next block, never to admit a waiting one, and never
for a slot.

The scheduler (``backfill_vllm.scheduler``) builds the view, carries the plan out and counts
what it did. Nothing here imports vLLM.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from backfill_vllm.settings import SchedulerSettings
from backfill_vllm.stepmodel import StepFit


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One request as the step plan sees it."""

    request_id: str
    batch: bool
    resident: bool
    """Running: it holds a sequence slot and its KV blocks (else it waits to be admitted)."""
    prefill_tokens: int
    """Tokens it must still compute before it decodes (its prompt, or prompt and output after
    a preemption); 0 while decoding."""
    paused_steps: int = 0
    """Steps in a row it has been paused so far."""
    last_progress_s: float | None = None
    """When it last carried tokens (or arrived); what the starvation bound counts from."""


@dataclass(frozen=True, slots=True)
class StepView:
    sequences: Sequence[SequenceView]
    now: float
    fit: StepFit | None
    """The fitted step-time model; None before it has enough samples."""
    last_step_s: float
    """How long the previous step took (what the next is expected to take)."""
    token_budget: int
    """The most tokens vLLM schedules in one step."""
    interactive_quiet_s: float = 0.0
    """Seconds since an interactive request was last in the engine (0 while one is)."""
    async_steps: bool = False
    """The engine schedules a step before the one in flight has come back (async
    scheduling): an arrival waits for both."""
    step_in_flight: bool = False
    """A step scheduled before this one has not come back yet: this one is scheduled ahead
    (async scheduling)."""


@dataclass(frozen=True, slots=True)
class StepPlan:
    holding: bool
    """Interactive work waits or prefills: batch yields this step."""
    paused: frozenset[str]
    """Resident batch sequences that carry no tokens this step."""
    relieved: frozenset[str]
    """Paused batch sequences at their starvation bound: they carry tokens this step."""
    riding: frozenset[str]
    """Batch decoders that ride along in this holding step (the ride-along share)."""
    chunk_cap: int
    """The batch prefill cap sized for this step."""
    prefill_allowance: int
    """Batch prefill tokens this step may carry, all batch sequences together."""
    admit_batch: bool
    """Whether waiting batch requests may be admitted this step."""
    held_tokens: int
    """Tokens the paused sequences would have carried this step."""
    lifted: bool = False
    """The cap is lifted this step (no interactive request in the engine for a while)."""
    admitted: frozenset[str] = frozenset()
    """Waiting batch requests at their starvation bound: admitted in this holding step."""
    bounded: bool = False
    """The whole-step bound trimmed batch in this step (decodes in turns, or prefill)."""
    held_back: bool = False
    """Not scheduled ahead: this step carries nothing, so the engine waits for the step in
    flight before it schedules the next (interactive work likely, none in the engine)."""
    idle_ready: bool = False
    """Batch sits this step out (interactive work in the engine, none waiting, or right after
    it): only a sequence at its starvation bound moves."""


def chunk_cap(settings: SchedulerSettings, fit: StepFit | None, token_budget: int) -> int:
    """Batch prefill tokens one step may carry: what the model says fits ``chunk_target_s``
    (never under ``min_chunk_tokens`` nor over ``max_chunk_tokens``), ``chunk_tokens`` before
    it has a fit."""
    if fit is None:
        cap = settings.chunk_tokens
    else:
        cap = max(settings.min_chunk_tokens, fit.tokens_within(settings.chunk_target_s))
        # A near-flat slope (a bad fit) must not lift the cap to vLLM's whole budget.
        cap = min(cap, settings.max_chunk_tokens)
    return max(1, min(cap, token_budget))


def lifted_cap(settings: SchedulerSettings, fit: StepFit | None, token_budget: int) -> int:
    """Batch prefill tokens a step may carry once the cap is lifted (never under the capped
    chunk, never over vLLM's budget): what fits ``lifted_step_target_s`` by the model; without
    one, what keeps the step's fixed cost at ``lift_fixed_share`` of the step; vLLM's whole
    budget before the model has a fit, or when the fit has no fixed cost to weigh."""
    if fit is None:
        return token_budget
    if settings.lifted_step_target_s > 0:
        tokens = fit.tokens_within(settings.lifted_step_target_s)
    elif settings.lift_fixed_share > 0 and fit.base_s > 0:
        # base / (base + b * tokens) = share  <=>  b * tokens = base * (1 / share - 1)
        tokens = fit.tokens_within(fit.base_s * (1 / settings.lift_fixed_share - 1))
    else:
        return token_budget
    return max(chunk_cap(settings, fit, token_budget), min(token_budget, tokens))


def cap_lifted(settings: SchedulerSettings, view: StepView) -> bool:
    """Whether batch prefill runs uncapped this step: no interactive request has been in the
    engine for ``lift_cap_after_s`` (none can be waiting behind the step)."""
    lift = settings.lift_cap_after_s
    return lift > 0 and view.interactive_quiet_s >= lift


def starved(settings: SchedulerSettings, seq: SequenceView, now: float, step_s: float) -> bool:
    """Whether paused ``seq`` must progress in the step starting at ``now`` (expected to take
    ``step_s``): waiting one more step would break a bound."""
    n, t = settings.starvation_steps, settings.starvation_s
    if n > 0 and seq.paused_steps + 1 >= n:
        return True
    if t > 0 and seq.last_progress_s is not None:
        return now + 2 * step_s - seq.last_progress_s > t
    return False


def _held(seq: SequenceView, cap: int) -> int:
    return min(seq.prefill_tokens, cap) if seq.prefill_tokens > 0 else 1


def plan_step(view: StepView, settings: SchedulerSettings) -> StepPlan:
    """What batch may do in the next step."""
    cap = chunk_cap(settings, view.fit, view.token_budget)
    interactive = [s for s in view.sequences if not s.batch]
    holding = any(not s.resident or s.prefill_tokens > 0 for s in interactive)
    if not holding and idle_ready(settings.idle_ready_s, view.interactive_quiet_s):
        return _yielding_step(view, settings, cap, holding=False)
    if not holding:
        lifted = cap_lifted(settings, view)
        if lifted:
            cap = lifted_cap(settings, view.fit, view.token_budget)
        if interactive_likely(settings, view):
            # A lifted step too (a lift sooner than the window's end): it is the longest.
            if not interactive and not settings.ahead_while_likely and scheduled_ahead(view):
                return _held_back_step(view, cap)
            if not lifted and view.fit is not None:
                return _bounded_step(view, settings, view.fit, cap)
        return StepPlan(False, frozenset(), frozenset(), frozenset(), cap, cap, True, 0, lifted)
    return _yielding_step(view, settings, cap, holding=True)


def idle_ready(window_s: float, interactive_quiet_s: float) -> bool:
    """Whether batch sits a step out, leaving the engine to interactive work and idle for its
    next arrival: interactive work is in the engine (``interactive_quiet_s`` is 0) or was
    within ``window_s`` (``idle_ready_s``; 0: never). The simulator
    (``backfill_analysis.simulate``) runs this same rule."""
    return interactive_quiet_s < window_s


def _yielding_step(
    view: StepView, settings: SchedulerSettings, cap: int, *, holding: bool
) -> StepPlan:
    """Batch yields the step (``holding``: to interactive work waiting or prefilling; else to
    the arrival expected right after interactive work): resident batch pauses, none is
    admitted, but for those at their starvation bound (and, holding, the ride-along share)."""
    interactive = [s for s in view.sequences if not s.batch]
    resident = [s for s in view.sequences if s.batch and s.resident]
    step_s = view.last_step_s if view.last_step_s > 0 else settings.chunk_target_s
    relieved = [s for s in resident if starved(settings, s, view.now, step_s)]
    relieved_ids = {s.request_id for s in relieved}

    riders: list[SequenceView] = []
    if holding and settings.ride_along_share > 0:
        room = _ride_along_tokens(view, settings, interactive, cap)
        candidates = sorted(
            (s for s in resident if s.prefill_tokens == 0 and s.request_id not in relieved_ids),
            key=lambda s: (-s.paused_steps, s.last_progress_s or 0.0, s.request_id),
        )
        riders = candidates[:room]
    moving = relieved_ids | {s.request_id for s in riders}
    paused = [s for s in resident if s.request_id not in moving]
    # Waiting batch gets the same bound in seconds (it has no paused steps to count).
    admitted = [
        s
        for s in view.sequences
        if s.batch and not s.resident and starved(settings, s, view.now, step_s)
    ]
    # Relieved prefills and starved admissions share one capped chunk; nobody else gets
    # batch prefill while holding.
    allowance = cap if admitted or any(s.prefill_tokens > 0 for s in relieved) else 0
    return StepPlan(
        holding=holding,
        paused=frozenset(s.request_id for s in paused),
        relieved=frozenset(relieved_ids),
        riding=frozenset(s.request_id for s in riders),
        chunk_cap=cap,
        prefill_allowance=allowance,
        admit_batch=False,
        held_tokens=sum(_held(s, cap) for s in paused),
        admitted=frozenset(s.request_id for s in admitted),
        idle_ready=not holding,
    )


def interactive_likely(settings: SchedulerSettings, view: StepView) -> bool:
    """Whether interactive work is in the engine or was within ``interactive_likely_s``."""
    return view.interactive_quiet_s < settings.interactive_likely_s


def scheduled_ahead(view: StepView) -> bool:
    """Whether this step is scheduled while the one before it still runs (async scheduling)."""
    return view.async_steps and view.step_in_flight


def step_target_s(settings: SchedulerSettings, view: StepView) -> float:
    """What batch may add to one step: ``chunk_target_s``, halved for a step scheduled ahead
    (an arrival waits for the step in flight and this one)."""
    return settings.chunk_target_s / (2 if scheduled_ahead(view) else 1)


def _held_back_step(view: StepView, cap: int) -> StepPlan:
    """An empty step in place of a batch-only one scheduled ahead: vLLM's engine loop then
    waits for the step in flight and schedules the next with whatever arrived meanwhile."""
    resident = [s for s in view.sequences if s.batch and s.resident]
    return StepPlan(
        holding=False,
        paused=frozenset(s.request_id for s in resident),
        relieved=frozenset(),
        riding=frozenset(),
        chunk_cap=cap,
        prefill_allowance=0,
        admit_batch=False,
        held_tokens=0,
        held_back=True,
    )


def _bounded_step(view: StepView, settings: SchedulerSettings, fit: StepFit, cap: int) -> StepPlan:
    """A step no interactive work waits in, but may arrive in: batch adds at most the step
    target to it, decodes first (they hold KV and a slot already), in turns if need be."""
    target = step_target_s(settings, view)
    decoders = [s for s in view.sequences if s.batch and s.resident and s.prefill_tokens == 0]
    room = fit.decodes_within(target)
    if len(decoders) <= room:
        left = target - fit.decode_s * len(decoders)
        allowance = min(cap, max(settings.min_chunk_tokens, fit.tokens_within(left)))
        return StepPlan(
            holding=False,
            paused=frozenset(),
            relieved=frozenset(),
            riding=frozenset(),
            chunk_cap=cap,
            prefill_allowance=allowance,
            admit_batch=True,
            held_tokens=0,
            bounded=allowance < cap,
        )
    # Decodes alone pass the target: they take turns, the longest without progress first;
    # batch prefill waits (the least chunk keeps it moving).
    # Those that moved in the same step tie on their progress time: a tie-break that changes
    # every step (not the id, which would favour the same few each time).
    turn = sorted(
        decoders,
        key=lambda s: (
            s.last_progress_s or 0.0,
            zlib.crc32(f"{s.request_id}:{view.now!r}".encode()),
        ),
    )
    moving = max(1, room)
    paused = turn[moving:]
    return StepPlan(
        holding=False,
        paused=frozenset(s.request_id for s in paused),
        relieved=frozenset(),
        riding=frozenset(),
        chunk_cap=cap,
        prefill_allowance=min(cap, settings.min_chunk_tokens),
        admit_batch=True,
        held_tokens=len(paused),
        bounded=True,
    )


def _ride_along_tokens(
    view: StepView, settings: SchedulerSettings, interactive: Sequence[SequenceView], cap: int
) -> int:
    """Batch decode tokens that fit in ``ride_along_share`` of the step's time without them."""
    work = sum(
        min(s.prefill_tokens, view.token_budget) if s.prefill_tokens else 1 for s in interactive
    )
    work = min(work, view.token_budget)
    if view.fit is None:
        return math.floor(settings.ride_along_share * min(work, cap))
    return view.fit.decodes_within(settings.ride_along_share * view.fit.seconds(work))


@dataclass(frozen=True, slots=True)
class VictimView:
    """A running batch sequence that could be preempted."""

    request_id: str
    computed_tokens: int
    """What preempting it throws away (recomputed when it resumes, less prefix-cache hits)."""
    blocks: int
    """KV blocks preempting it frees."""
    arrival_s: float


def _victim_order(candidates: Sequence[VictimView]) -> list[VictimView]:
    # Lose the least work; among equals the newest goes first (as vLLM picks).
    return sorted(candidates, key=lambda v: (v.computed_tokens, -v.arrival_s, v.request_id))


def slot_victims(
    candidates: Sequence[VictimView], free_slots: int, interactive_waiting: int
) -> list[str]:
    """Batch sequences to preempt so ``interactive_waiting`` requests find a sequence slot
    (``free_slots`` are free now)."""
    short = min(interactive_waiting, interactive_waiting - free_slots, len(candidates))
    if short <= 0:
        return []
    return [v.request_id for v in _victim_order(candidates)[:short]]


def kv_victims(
    candidates: Sequence[VictimView], free_blocks: int, needs: Sequence[int]
) -> list[str]:
    """Batch sequences to preempt so the waiting interactive requests, in the order they are
    admitted, find the KV blocks they need (``needs``, one figure each). Preempts only for the
    requests it can make room for in full: freeing blocks that still leave the next request
    short would throw batch work away for nothing."""
    room = free_blocks + sum(v.blocks for v in candidates)
    wanted = 0
    for need in needs:
        if wanted + need > room:
            break
        wanted += need
    victims: list[str] = []
    have = free_blocks
    for victim in _victim_order(candidates):
        if have >= wanted:
            break
        victims.append(victim.request_id)
        have += victim.blocks
    return victims
