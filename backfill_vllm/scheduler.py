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

What it leaves to modules that import no vLLM: what batch each step may do
(``backfill_vllm.policy``), what it remembers of each batch request and records of each step
(``backfill_vllm.tracks``), where interactive requests' first-token time goes
(``backfill_vllm.ttftsplit``), vLLM's waiting queues as it reads and borrows them
(``backfill_vllm.queues``), the steps in flight and their times (``backfill_vllm.stepmodel``),
and the KV blocks it reads from vLLM's cache manager (``backfill_vllm.kvblocks``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from vllm import __version__ as vllm_version

from backfill_vllm import __version__
from backfill_vllm.compat import check_vllm_version

check_vllm_version(vllm_version)

from vllm.logger import init_logger  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.interface import PauseState  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.request_queue import SchedulingPolicy  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from backfill_vllm.kvblocks import blocks_to_start, freed_blocks, held_hits  # noqa: E402
from backfill_vllm.metrics import SchedulerMetrics, serve_shared  # noqa: E402
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
from backfill_vllm.queues import put_back, set_aside, waiting_interactive  # noqa: E402
from backfill_vllm.refusals import (  # noqa: E402
    EngineFacts,
    UnsupportedEngineConfigError,
    refusal_line,
    refusals,
)
from backfill_vllm.settings import SchedulerSettings  # noqa: E402
from backfill_vllm.stepmodel import StepsInFlight, StepTimeModel  # noqa: E402
from backfill_vllm.tracks import BatchTracks  # noqa: E402
from backfill_vllm.ttftsplit import TtftSplits, core_arrival  # noqa: E402

# Under "vllm." so vLLM's logging configuration (handler, format, level) applies.
logger = init_logger("vllm.backfill_vllm")


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
        self._tracks = BatchTracks(self.backfill_metrics)
        self._splits = TtftSplits(self.backfill_metrics)
        self._plan: StepPlan | None = None
        self._allowance_left = 0
        self._capped = 0
        self._preempt_reason: str | None = None
        self._steps = StepsInFlight()
        self._held_back_last = False
        self._interactive_seen_s = time.monotonic()
        """When an interactive request was last in the engine (quiet counts from the start)."""
        where = (
            serve_shared(self.backfill_metrics, s.metrics_host, s.metrics_port)
            if s.metrics_port
            else "not served"
        )
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
        """Waiting interactive requests that can start this step, in the order vLLM admits
        them (under the priority policy, without walking the batch backlog)."""
        return waiting_interactive(
            self.kv_holding_waiting,
            self.waiting,
            self.backfill.batch_priority,
            self.policy == SchedulingPolicy.PRIORITY,
            self._startable,
        )

    # -- the step ------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        known = request.request_id in self.requests
        super().add_request(request)
        if known:
            return
        if self.is_batch(request):
            self._tracks.arrived(request.request_id, time.monotonic())
        else:
            arrived = core_arrival(time.monotonic(), time.time(), request.arrival_time)
            self._splits.arrived(request.request_id, arrived, bool(self._steps))

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        now = time.monotonic()
        plan = plan_step(self._view(now), self.backfill)
        if plan.holding:
            self._make_room()
        # Waiting batch that may not start this step is set aside, never given 0 tokens in
        # vLLM's waiting scan (0.32 stops the scan there, whoever waits behind it).
        aside = (
            set_aside(
                self.kv_holding_waiting, self.waiting, self.backfill.batch_priority, plan.admitted
            )
            if not plan.admit_batch or plan.prefill_allowance <= 0
            else []
        )
        self._plan, self._allowance_left, self._capped = plan, plan.prefill_allowance, 0
        try:
            output = super().schedule(throttle_prefills)
        finally:
            self._plan = None
            put_back(aside)
        resident = self._resident_batch()
        self._tracks.account(
            plan,
            output.num_scheduled_tokens,
            self._is_running,
            resident,
            self._capped,
            self._step_model,
            now,
        )
        self._held_back_last = plan.held_back
        if output.total_num_scheduled_tokens > 0:
            decodes = sum(1 for n in output.num_scheduled_tokens.values() if n == 1)
            sent = time.monotonic()
            self._steps.sent(id(output), sent, output.total_num_scheduled_tokens, decodes)
            if self._splits:
                self._splits.scheduled(output.num_scheduled_tokens, id(output), sent)
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
            self._steps.last_step_s,
            self.max_num_scheduled_tokens,
            interactive_quiet_s=quiet_s,
            async_steps=bool(self.scheduler_config.async_scheduling),
            # Never two steps held back in a row: after one, vLLM's loop has waited for the
            # step in flight, so an entry still here is one that never came back.
            step_in_flight=bool(self._steps) and not self._held_back_last,
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
            blocks_to_start(
                r.num_computed_tokens,
                chunk,
                self.num_lookahead_tokens,
                self.max_model_len,
                self.block_size,
                groups,
            )
            for r, chunk in zip(admissible, chunks, strict=False)
        ]
        # Prompt blocks running requests already hold (a shared prefix) take no free block.
        needs = [max(0, n - held_hits(manager, r)) for n, r in zip(needs, admissible, strict=False)]
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
                freed_blocks(self.kv_cache_manager, r),
                r.arrival_time,
            )
            for r in self.running
            if self.is_batch(r) and r.status == RequestStatus.RUNNING
        ]

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
            self._tracks.preempted(request.request_id, self._preempt_reason or "kv")
        super()._preempt_request(request, timestamp, drop_stale_output=drop_stale_output)

    # -- what happened -------------------------------------------------------------------

    def _is_running(self, request_id: str) -> bool:
        request = self.requests.get(request_id)
        return request is not None and request.status == RequestStatus.RUNNING

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
        measured = self._steps.came_back(id(scheduler_output), now)
        if measured is not None:
            tokens, seconds, decodes = measured
            self._step_model.observe(tokens, seconds, decodes=decodes)
        started = now - measured[1] if measured is not None else None
        self._splits.came_back(id(scheduler_output), started, now)
        result = super().update_from_output(scheduler_output, model_runner_output)
        for request_id in self._splits.waiting_first_token() if self._splits else ():
            request = self.requests.get(request_id)
            if request is not None and request.num_output_tokens > 0:
                self._splits.first_token(request_id, now)
        return result

    def _free_request(self, request: Request, delay_free_blocks: bool = False) -> Any:
        self._tracks.freed(request.request_id)
        self._splits.freed(request.request_id, request.num_output_tokens > 0)
        return super()._free_request(request, delay_free_blocks=delay_free_blocks)


class BackfillAsyncScheduler(BackfillScheduler, AsyncScheduler):
    """The same scheduler over vLLM's ``AsyncScheduler`` (chosen by ``BackfillScheduler``
    itself when the engine runs with async scheduling)."""
