"""``BackfillScheduler``: vLLM's V1 scheduler, with batch yielding inside the step.

``vllm serve ... --scheduling-policy priority --scheduler-cls
backfill_vllm.scheduler.BackfillScheduler``. Requests at ``BACKFILL_SCHED_BATCH_PRIORITY``
(10, what Backfill's worker sends) or above are batch. Each step, before vLLM's own
``schedule()`` runs, :func:`backfill_vllm.policy.plan_step` decides what batch may do; vLLM
then schedules exactly as it always does, except that every batch request's tokens for the
step pass through one cap (:meth:`BackfillScheduler._reserve_prefill_lookahead`, the hook
vLLM calls for each request right before it allocates KV slots):

- a *paused* sequence gets 0 tokens: it stays in ``running`` with its KV blocks, slot and
  ``num_computed_tokens`` (vLLM already skips running requests that get no tokens in a step,
  e.g. when the token budget runs out), so nothing is aborted or recomputed, and an abort or
  finish while paused is vLLM's ordinary path;
- batch prefill, all batch requests together, gets at most the step's chunk cap; a prefill
  vLLM would not split (chunked prefill off, Mamba block alignment, encoder inputs, pooling,
  a seeded request on CPU) gets its whole chunk or nothing, and a cut chunk keeps vLLM's MTP
  prefill-lookahead rule;
- waiting batch is not admitted while interactive work that can start this step is pending.
  It is *set aside*: taken out of vLLM's waiting queues for the step and put back after it,
  never given 0 tokens in vLLM's waiting scan, which reads 0 as "admit nobody else this
  step" (vLLM 0.32) and would leave every interactive request behind it waiting.

Because paused batch stays in ``running``, vLLM's priority policy still preempts batch first
when a running interactive request needs a KV block. What it does not do is closed here,
before its ``schedule()``: it never preempts to *admit* a waiting request, so with the
sequence slots (``--max-num-seqs``) or the KV blocks held by batch, interactive work would
wait for batch to finish; the scheduler preempts batch for it (:func:`policy.slot_victims`,
:func:`policy.kv_victims`).

Under async scheduling (vLLM's default where the executor supports it) the class builds as
``BackfillAsyncScheduler``, the same rules over vLLM's ``AsyncScheduler``. There vLLM's engine
loop schedules each step while the one before it runs; while interactive work is likely and
none is in the engine, a step that would carry batch alone is *held back* instead (the plan
pauses every batch request and admits none, so vLLM builds an empty step): the loop then waits
for the step in flight, and an interactive request arriving meanwhile is in the next step
rather than behind one more batch step.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm import __version__ as vllm_version

from backfill_vllm import __version__
from backfill_vllm.compat import check_vllm_version

check_vllm_version(vllm_version)

from vllm.logger import init_logger  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.utils.math_utils import cdiv  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.request_queue import RequestQueue, SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from backfill_vllm.metrics import SchedulerMetrics, serve_metrics  # noqa: E402
from backfill_vllm.policy import (  # noqa: E402
    SequenceView,
    StepPlan,
    StepView,
    VictimView,
    idle_ready,
    kv_victims,
    plan_step,
    slot_victims,
)
from backfill_vllm.refusals import (  # noqa: E402
    EngineFacts,
    UnsupportedEngineConfigError,
    refusal_line,
    refusals,
)
from backfill_vllm.settings import SchedulerSettings  # noqa: E402
from backfill_vllm.stepmodel import StepTimeModel  # noqa: E402

# Under "vllm." so vLLM's logging configuration (handler, format, level) applies.
logger = init_logger("vllm.backfill_vllm")

# One metrics server per (host, port) in a process; a scheduler built later (tests, an engine
# restarted in-process) takes it over.
_served: dict[tuple[str, int], list[SchedulerMetrics]] = {}


@dataclass
class _BatchTrack:
    """What the scheduler remembers of one batch request between steps."""

    last_progress_s: float
    paused_steps: int = 0
    pause_started_s: float | None = None
    pauses: int = 0


class BackfillScheduler(Scheduler):
    def __new__(cls, *args: Any, **kwargs: Any) -> BackfillScheduler:
        chosen = cls
        if cls is BackfillScheduler:
            config = kwargs.get("vllm_config", args[0] if args else None)
            if getattr(getattr(config, "scheduler_config", None), "async_scheduling", False):
                chosen = BackfillAsyncScheduler
        return super().__new__(chosen)

    def __init__(
        self, *args: Any, settings: SchedulerSettings | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        reasons = refusals(self._engine_facts())
        if reasons:
            raise UnsupportedEngineConfigError(refusal_line(reasons))
        self.backfill = settings or SchedulerSettings.from_env()
        s = self.backfill
        self.backfill_metrics = SchedulerMetrics(__version__, vllm_version, s.batch_priority)
        self._step_model = StepTimeModel(s.model_window, s.model_min_samples)
        self._tracks: dict[str, _BatchTrack] = {}
        self._plan: StepPlan | None = None
        self._allowance_left = 0
        self._capped = 0
        self._preempt_reason: str | None = None
        self._in_flight: dict[int, tuple[int, float, int, int]] = {}
        """Steps scheduled and not yet come back, by their output's id: (order, when
        scheduled, tokens, decodes)."""
        self._scheduled = 0
        self._held_back_last = False
        self._last_update_s = 0.0
        self._last_step_s = 0.0
        self._interactive_seen_s = time.monotonic()
        """When an interactive request was last in the engine (quiet counts from the start)."""
        where = "not served"
        if s.metrics_port:
            key = (s.metrics_host, s.metrics_port)
            holder = _served.get(key)
            if holder is not None:
                holder[0] = self.backfill_metrics
                where = f"http://{s.metrics_host}:{s.metrics_port}/metrics"
            else:
                holder = [self.backfill_metrics]
                if serve_metrics(lambda: holder[0].render(), *key) is not None:  # noqa: PLW0108
                    _served[key] = holder
                    where = f"http://{s.metrics_host}:{s.metrics_port}/metrics"
        logger.info(
            "backfill_vllm %s (%s): batch is priority >= %d; chunk target %.3f s, lifted after "
            "%.1f s without interactive work (lift fixed share %.2f); whole-step bound %.1f s "
            "after interactive work, batch-only steps %s within it; ride-along %.2f; "
            "starvation bound %d steps / "
            "%.2f s; metrics %s",
            __version__,
            type(self).__name__,
            s.batch_priority,
            s.chunk_target_s,
            s.lift_cap_after_s,
            s.lift_fixed_share,
            s.interactive_likely_s,
            "scheduled ahead" if s.ahead_while_likely else "held back under async scheduling",
            s.ride_along_share,
            s.starvation_steps,
            s.starvation_s,
            where,
        )

    def _engine_facts(self) -> EngineFacts:
        parallel = self.parallel_config
        connector = getattr(self, "connector", None)
        return EngineFacts(
            scheduling_policy=self.policy.value,
            pipeline_parallel_size=int(parallel.pipeline_parallel_size),
            data_parallel_size=int(parallel.data_parallel_size),
            kv_connector=type(connector).__name__ if connector is not None else None,
            num_spec_tokens=int(getattr(self, "num_spec_tokens", 0) or 0),
        )

    # -- classes -------------------------------------------------------------------------

    def is_batch(self, request: Request) -> bool:
        return bool(request.priority >= self.backfill.batch_priority)

    def _startable(self, request: Request, kv_holding: bool) -> bool:
        """Whether vLLM's waiting scan could start ``request`` this step: not while it waits
        for streaming input, a remote KV load or its grammar, nor from ``waiting`` while vLLM's
        own pause state admits nothing new. Only such work holds batch back."""
        if self._pause_state == PauseState.PAUSED_ALL:
            return False
        if not kv_holding and self._pause_state != PauseState.UNPAUSED:
            return False
        status = request.status
        if status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            return False
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            return request.request_id in self.finished_recving_kv_req_ids
        if status == RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR:
            wanted = request.structured_output_request
            return (
                wanted is not None
                and wanted.grammar is not None
                and not isinstance(wanted.grammar, Exception)
            )
        return True

    def _whole_or_nothing(self, request: Request) -> bool:
        """A request whose prefill chunk the cap must not cut, only grant or withhold whole:
        where vLLM itself would not split it (chunked prefill off; Mamba/hybrid chunks aligned
        to blocks; encoder inputs, whose placement vLLM has already sized; pooling requests),
        and on CPU one with a seed (vLLM 0.32's CPU runner rewinds a seeded request's
        generator after a partial prefill, which torch's CPU generator refuses: "CPU Generator
        does not use offset", and the engine dies)."""
        if not self.scheduler_config.enable_chunked_prefill:
            return True
        if getattr(self, "need_mamba_block_aligned_split", False):
            return True
        if request.has_encoder_inputs or request.pooling_params is not None:
            return True
        params = request.sampling_params
        return params is not None and params.seed is not None and current_platform.is_cpu()

    def _waiting_interactive(self) -> Iterator[Request]:
        """Waiting interactive requests in the order vLLM admits them. Under the priority
        policy the queues are ordered by priority, so this stops at the first batch request
        instead of walking a long batch backlog every step."""
        bar = self.backfill.batch_priority
        ordered = self.policy == SchedulingPolicy.PRIORITY
        for queue in (self.kv_holding_waiting, self.waiting):
            if ordered and (not queue or queue.peek_request().priority >= bar):
                continue
            kv_holding = queue is self.kv_holding_waiting
            for request in queue:
                if request.priority < bar:
                    if self._startable(request, kv_holding):
                        yield request
                elif ordered:
                    break

    def _set_aside_waiting_batch(
        self, keep: frozenset[str]
    ) -> list[tuple[RequestQueue, list[Request]]]:
        """Take the waiting batch requests (but ``keep``) out of vLLM's queues for one step."""
        bar = self.backfill.batch_priority
        aside: list[tuple[RequestQueue, list[Request]]] = []
        for queue in (self.kv_holding_waiting, self.waiting):
            batch = [r for r in queue if r.priority >= bar and r.request_id not in keep]
            if batch:
                queue.remove_requests(batch)
                aside.append((queue, batch))
        return aside

    @staticmethod
    def _put_back(aside: list[tuple[RequestQueue, list[Request]]]) -> None:
        for queue, batch in aside:
            for request in batch:
                queue.add_request(request)

    # -- the step ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        known = request.request_id in self.requests
        super().add_request(request)
        if not known and self.is_batch(request):
            self._tracks[request.request_id] = _BatchTrack(time.monotonic())
            with self.backfill_metrics.lock:
                self.backfill_metrics.batch_requests += 1

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        now = time.monotonic()
        plan = plan_step(self._view(now), self.backfill)
        if plan.holding:
            self._make_room()
        # Waiting batch that may not start this step is set aside, never given 0 tokens in
        # vLLM's waiting scan (0.32 stops the scan there, whoever waits behind it).
        aside = (
            self._set_aside_waiting_batch(plan.admitted)
            if not plan.admit_batch or plan.prefill_allowance <= 0
            else []
        )
        self._plan, self._allowance_left, self._capped = plan, plan.prefill_allowance, 0
        try:
            output = super().schedule(throttle_prefills)
        finally:
            self._plan = None
            self._put_back(aside)
        self._account(plan, output, now)
        self._held_back_last = plan.held_back
        if output.total_num_scheduled_tokens > 0:
            if len(self._in_flight) > 16:
                self._in_flight.clear()  # outputs that never came back (engine reset)
            decodes = sum(1 for n in output.num_scheduled_tokens.values() if n == 1)
            self._scheduled += 1
            self._in_flight[id(output)] = (
                self._scheduled,
                time.monotonic(),
                output.total_num_scheduled_tokens,
                decodes,
            )
        return output

    def _view(self, now: float) -> StepView:
        """What the plan needs: nothing of batch unless interactive work is pending (the
        common step costs one pass over ``running`` and a peek at the queues)."""
        bar = self.backfill.batch_priority
        waiting = list(self._waiting_interactive())
        pending = bool(waiting)
        present = pending
        for r in self.running:
            if r.priority < bar:
                present = True
                if r.num_tokens - r.num_computed_tokens > 1:
                    pending = True
                    break
        if present:
            self._interactive_seen_s = now
        quiet_s = 0.0 if present else now - self._interactive_seen_s
        likely = quiet_s < self.backfill.interactive_likely_s
        # Idle-ready: batch sits out, but for those at their starvation bound, waiting ones too.
        idle = idle_ready(self.backfill.idle_ready_s, quiet_s)
        sequences: list[SequenceView] = []
        if pending or idle:
            sequences = [self._sequence(r, True) for r in self.running]
            sequences += [self._sequence(r, False) for r in waiting]
            sequences += [
                self._sequence(r, False)
                for queue in (self.kv_holding_waiting, self.waiting)
                for r in queue
                if r.priority >= bar
            ]
        elif likely:
            sequences = [self._sequence(r, True) for r in self.running]
        return StepView(
            sequences,
            now,
            self._step_model.fit(),
            self._last_step_s,
            self.max_num_scheduled_tokens,
            interactive_quiet_s=quiet_s,
            async_steps=bool(self.scheduler_config.async_scheduling),
            # Never two steps held back in a row: after one, vLLM's loop has waited for the
            # step in flight, so an entry still here is one that never came back.
            step_in_flight=bool(self._in_flight) and not self._held_back_last,
        )

    def _sequence(self, request: Request, resident: bool) -> SequenceView:
        batch = self.is_batch(request)
        # Decoding: everything but the last sampled token is computed (or, under async
        # scheduling, the in-flight placeholder is counted as computed already).
        left = request.num_tokens - request.num_computed_tokens
        prefill = max(0, left - 1) if resident else max(1, left)
        track = self._tracks.get(request.request_id) if batch else None
        return SequenceView(
            request.request_id,
            batch,
            resident,
            prefill,
            track.paused_steps if track else 0,
            track.last_progress_s if track else None,
        )

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        """vLLM asks this of every request it is about to give tokens, running and waiting,
        right before allocating their KV slots: the one place batch's tokens are capped."""
        granted = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        plan = self._plan
        if plan is None or granted <= 0 or not self.is_batch(request):
            return int(granted)
        if request.request_id in plan.paused:
            return 0
        if (
            request.status != RequestStatus.RUNNING
            and not plan.admit_batch
            and request.request_id not in plan.admitted
        ):
            return 0
        if request.num_tokens - num_computed_tokens <= 1:
            return int(granted)  # a decode token
        if granted > self._allowance_left and self._whole_or_nothing(request):
            # Its prefill must not be cut by the cap: whole, as the step's first batch
            # prefill, or not in this step.
            whole = self._allowance_left == plan.prefill_allowance
            self._allowance_left = 0
            if not whole:
                self._capped += granted
            return int(granted) if whole else 0
        allowed = min(granted, self._allowance_left)
        if allowed < granted:
            # A cut chunk keeps vLLM's rule too: never end within the MTP prefill lookahead.
            allowed = super()._reserve_prefill_lookahead(request, num_computed_tokens, allowed)
        self._capped += granted - allowed
        self._allowance_left -= allowed
        return int(allowed)

    # -- room for interactive work ---------------------------------------------------------

    def _make_room(self) -> None:
        """Preempt running batch so the waiting interactive requests this step can admit get
        a sequence slot and the KV blocks they need (vLLM preempts only for running
        requests). Only those the step's token budget reaches: a request that would wait
        for budget anyway is no reason to throw batch work away yet."""
        waiting = [
            r
            for r in self._waiting_interactive()
            if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        ]
        if not waiting:
            return
        budget = self.max_num_scheduled_tokens - sum(
            min(max(1, r.num_tokens - r.num_computed_tokens), self.max_num_scheduled_tokens)
            for r in self.running
            if not self.is_batch(r)
        )
        reached: list[Request] = []
        chunks: list[int] = []
        for request in waiting:
            if budget <= 0:
                break
            left = max(1, request.num_tokens - request.num_computed_tokens)
            reached.append(request)
            chunks.append(min(left, budget))  # its first chunk: what this step can give it
            budget -= left
        free_slots = (
            self.max_num_active_reqs - len(self.running) - self.num_waiting_for_streaming_input
        )
        victims = slot_victims(self._victims(), free_slots, len(reached))
        self._preempt(victims, "seqs")
        admissible = reached[: max(0, free_slots + len(victims))]
        if not admissible:
            return
        manager = self.kv_cache_manager
        # Blocks this step allocates for each (its first chunk and lookahead slots, less what
        # it holds already), in every KV cache group.
        groups = max(1, len(self.kv_cache_config.kv_cache_groups))
        needs = [
            groups
            * max(
                0,
                cdiv(
                    min(
                        r.num_computed_tokens + chunk + self.num_lookahead_tokens,
                        self.max_model_len,
                    ),
                    self.block_size,
                )
                - cdiv(r.num_computed_tokens, self.block_size),
            )
            for r, chunk in zip(admissible, chunks, strict=False)
        ]
        # Prompt blocks running requests already hold (a shared prefix) take no free block.
        needs = [max(0, n - self._held_hits(r)) for n, r in zip(needs, admissible, strict=False)]
        if self.running:
            needs[0] += manager.watermark_blocks
        self._preempt(
            kv_victims(self._victims(), manager.block_pool.get_num_free_blocks(), needs), "kv"
        )

    def _victims(self) -> list[VictimView]:
        return [
            VictimView(
                r.request_id,
                r.num_computed_tokens,
                self._freed_blocks(r),
                r.arrival_time,
            )
            for r in self.running
            if self.is_batch(r) and r.status == RequestStatus.RUNNING
        ]

    def _held_hits(self, request: Request) -> int:
        """Blocks of ``request``'s prompt that the prefix cache has and running requests hold:
        admitting it takes no free block for them (a cached block nobody holds sits in the
        free pool, and taking it takes a free block)."""
        manager = self.kv_cache_manager
        if request.num_computed_tokens > 0 or not getattr(manager, "enable_caching", False):
            return 0
        if request.skip_reading_prefix_cache:
            return 0
        hit = manager.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        return sum(1 for blocks in hit[0] for b in blocks if b.ref_cnt > 0 and not b.is_null)

    def _freed_blocks(self, request: Request) -> int:
        """KV blocks preempting ``request`` gives back to the free pool, in every group: only
        those it alone holds (a block shared with another running request, a common prefix
        in the prefix cache, stays held)."""
        groups = self.kv_cache_manager.coordinator.get_blocks(request.request_id)
        return sum(1 for blocks in groups for b in blocks if b.ref_cnt == 1 and not b.is_null)

    def _preempt(self, request_ids: Iterable[str], reason: str) -> None:
        timestamp = time.monotonic()
        for request_id in request_ids:
            request = self.requests[request_id]
            self.running.remove(request)
            self._preempt_reason = reason
            try:
                self._preempt_request(request, timestamp)
            finally:
                self._preempt_reason = None

    def _preempt_request(
        self, request: Request, timestamp: float, drop_stale_output: bool = False
    ) -> None:
        if self.is_batch(request):
            reason = self._preempt_reason or "kv"
            with self.backfill_metrics.lock:
                if reason == "seqs":
                    self.backfill_metrics.preemptions_seqs += 1
                else:
                    self.backfill_metrics.preemptions_kv += 1
            track = self._tracks.get(request.request_id)
            if track is not None:
                track.paused_steps, track.pause_started_s = 0, None
        super()._preempt_request(request, timestamp, drop_stale_output=drop_stale_output)

    # -- what happened -------------------------------------------------------------------

    def _account(self, plan: StepPlan, output: SchedulerOutput, now: float) -> None:
        scheduled = output.num_scheduled_tokens
        resident = self._resident_batch()
        m = self.backfill_metrics
        with m.lock:
            m.steps += 1
            if plan.held_back:
                # Nobody was paused: the step in flight carries them.
                m.held_back_steps += 1
                return
            m.lifted_steps += plan.lifted
            m.bounded_steps += plan.bounded
            m.tokens_capped += self._capped
            m.chunk_cap = plan.chunk_cap
            m.fit = self._step_model.fit()
            m.step_outliers = self._step_model.outliers
            for request_id in scheduled:
                track = self._tracks.get(request_id)
                if track is not None:
                    track.last_progress_s = now
                    if track.pause_started_s is not None:
                        track.paused_steps, track.pause_started_s = 0, None
            paused_now = 0
            for request_id in plan.paused:
                track = self._tracks.get(request_id)
                if track is None or request_id in scheduled:
                    continue  # finished, or preempted and readmitted (not paused)
                request = self.requests.get(request_id)
                if request is None or request.status != RequestStatus.RUNNING:
                    track.paused_steps, track.pause_started_s = 0, None
                    continue  # preempted by vLLM in this step: waiting, not paused
                paused_now += 1
                if track.pause_started_s is None:
                    track.pause_started_s = now
                    track.pauses += 1
                    m.pauses += 1
                    m.most_pauses_per_request = max(m.most_pauses_per_request, track.pauses)
                track.paused_steps += 1
                m.longest_pause_steps = max(m.longest_pause_steps, track.paused_steps)
                m.longest_pause_s = max(m.longest_pause_s, now - track.pause_started_s)
            m.paused_now = paused_now
            m.running_now, m.decoding_now = resident
            if paused_now:
                m.paused_steps += 1
                m.tokens_held += plan.held_tokens
            m.relief += sum(1 for r in plan.relieved | plan.admitted if r in scheduled)
            m.ride_along += sum(1 for r in plan.riding if r in scheduled)

    def _resident_batch(self) -> tuple[int, int]:
        """Batch requests in the running set, and those of them past their prompts: one pass,
        taken before the metrics lock so a scrape never waits on it."""
        bar = self.backfill.batch_priority
        running = decoding = 0
        for r in self.running:
            if r.priority >= bar:
                running += 1
                decoding += r.num_computed_tokens >= r.num_prompt_tokens
        return running, decoding

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: Any
    ) -> Any:
        now = time.monotonic()
        sent = self._in_flight.pop(id(scheduler_output), None)
        if sent is not None:
            order, scheduled_s, tokens, decodes = sent
            # Steps come back in the order they were scheduled: one scheduled before this
            # one and still here never will.
            for key in [k for k, v in self._in_flight.items() if v[0] < order]:
                del self._in_flight[key]
            # The step ran from when it was scheduled, or from when the one before it came
            # back if it was queued behind that one (async scheduling).
            seconds = now - max(scheduled_s, self._last_update_s)
            self._step_model.observe(tokens, seconds, decodes=decodes)
            self._last_step_s = seconds
        self._last_update_s = now
        return super().update_from_output(scheduler_output, model_runner_output)

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        self._tracks.pop(request.request_id, None)
        return super()._free_request(request, delay_free_blocks=delay_free_blocks)


class BackfillAsyncScheduler(BackfillScheduler, AsyncScheduler):
    """The same scheduler over vLLM's ``AsyncScheduler`` (chosen by ``BackfillScheduler``
    itself when the engine runs with async scheduling)."""
