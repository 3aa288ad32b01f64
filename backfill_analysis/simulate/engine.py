"""A continuous-batching engine with a paged KV pool, stepped in simulated time.

Modelled on vLLM's V1 scheduler: every step first serves the running sequences (each decoding
sequence one token, partial prefills their next chunk), then admits waiting sequences in
priority order into what is left of the step's token budget (``max_num_batched_tokens``) and
sequence limit (``max_num_seqs``). KV blocks are allocated as sequences grow; when a running
sequence needs a block and none is free, the lowest-priority (latest) running sequence is
preempted by *recompute*: its blocks are freed and it waits to prefill prompt and output so
far again.

With a :class:`~backfill_analysis.simulate.stepsched.StepSchedule` (policy ``backfill-step``) the
engine runs Backfill's step-shaping scheduler instead: while any interactive sequence waits or
prefills, batch sequences carry no tokens (decoders are *paused*, resident with their blocks;
partial batch prefills get no chunk; waiting batch is not admitted) except those the starvation
bound or the ride-along share lets through; batch prefill per step is capped in step time; and a
waiting interactive sequence short of blocks or of a sequence slot preempts batch for them.

Speed: decoding sequences are kept as one aggregate. A sequence's length is
``entry_length + (step - entry_step)``, so the group's total context is one running sum, the
sequences needing a new block at step ``k`` are those whose ``(entry_step - entry_length)``
is ``k`` modulo the block size (a count per residue), and finishes come off a heap. A step
costs O(prefills + finishes + interactive decoders), not O(all decoders). Pausing takes the
batch decoders out of the aggregate (O(batch decoders) once per interactive burst) and resuming
puts them back; paused sequences that ride along are stepped one by one.

Shared prompt prefixes (issue 36): a sequence may name a prefix (``prefix``, ``prefix_blocks``
whole blocks); the engine's prefix cache (:class:`~backfill_analysis.simulate.prefix_cache.
PrefixCache`) holds its blocks once while any resident sequence uses them, and a sequence
admitted while they are cached starts past them (no prefill, no blocks of its own for them:
``shared``). A sequence's ``blocks`` are its own; ``blocks + shared`` cover its context.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

from backfill.capacity import blocks_for
from backfill_analysis.simulate.costmodel import CostModel, StepWork, prefill_attention
from backfill_analysis.simulate.prefix_cache import PrefixCache
from backfill_analysis.simulate.stepsched import (
    StepSchedule,
    chunk_tokens,
    decode_token_seconds,
    prefill_seconds,
    sits_out,
    starved,
)


@dataclass(frozen=True)
class EngineConfig:
    """One engine's pool and scheduler limits."""

    num_blocks: int
    block_size: int
    cost: CostModel
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    priority_scheduling: bool = True
    """False: first come first served; request priorities are ignored (as vLLM's fcfs)."""
    step_schedule: StepSchedule | None = None
    """Backfill's step-shaping scheduler (``backfill-step``); None: vLLM's stock scheduler."""
    async_scheduling: bool = False
    """vLLM's async scheduling (its default on GPU): each step is scheduled while the one
    before it runs, so a request arriving mid-step waits for that step and one more (the run
    loop admits arrivals at the previous step's start); Backfill's step target is halved for
    a step scheduled ahead."""
    host_gap_s: float = 0.0
    """Host time of one step (scheduling, input preparation, output processing) that async
    scheduling hides behind the step before: a step not scheduled ahead (sync scheduling, the
    first after an idle spell, or one Backfill holds back) leaves the device idle this long
    first. 0: steps are device time only."""
    prefix_caching: bool = True
    """vLLM's prefix caching (on by default): sequences naming a shared prefix share its
    cached blocks; False: each computes and holds its own."""

    def __post_init__(self) -> None:
        if (
            min(self.num_blocks, self.block_size, self.max_num_batched_tokens, self.max_num_seqs)
            <= 0
        ):
            raise ValueError(f"engine limits must be positive: {self}")
        if not (math.isfinite(self.host_gap_s) and self.host_gap_s >= 0):
            raise ValueError("host_gap_s must be >= 0 seconds")
        if self.step_schedule is not None and not self.priority_scheduling:
            raise ValueError(
                "the step-shaping scheduler tells batch from interactive by "
                "priority: it needs priority scheduling"
            )

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


# Sequence states inside the engine.
WAITING, PREFILL, DECODE, DONE, ABORTED, PAUSED = range(6)
"""PAUSED: a batch decoder the step-shaping scheduler holds resident (blocks and computed
tokens kept) while interactive work is pending; ``computed`` and ``generated`` are exact."""


class Sequence:
    """One request inside the engine (mutable; the engine owns its state)."""

    __slots__ = (
        "arrival_order",
        "blocks",
        "computed",
        "entry_length",
        "entry_step",
        "first_token_s",
        "generated",
        "interactive",
        "key",
        "last_token_s",
        "output_tokens",
        "owner",
        "preemptions",
        "prefix",
        "prefix_blocks",
        "priority",
        "progress_s",
        "progress_step",
        "prompt_tokens",
        "recomputed",
        "residue",
        "shared",
        "state",
        "target",
    )

    def __init__(
        self,
        key: int,
        prompt_tokens: int,
        output_tokens: int,
        priority: int,
        interactive: bool,
        owner: object = None,
        generated: int = 0,
        prefix: Hashable | None = None,
        prefix_blocks: int = 0,
    ) -> None:
        self.key = key
        self.prefix = prefix if prefix_blocks > 0 else None
        """The shared prompt prefix the prompt starts with (None: none)."""
        self.prefix_blocks = prefix_blocks if prefix_blocks > 0 else 0
        """Its whole blocks the engine's prefix cache may share."""
        self.shared = 0
        """Blocks of the cached prefix this sequence uses now (not in ``blocks``)."""
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.priority = priority
        self.interactive = interactive
        self.owner = owner
        self.generated = generated
        """Output tokens produced so far (kept across preemptions, as vLLM's recompute and
        Backfill's resume both keep them)."""
        self.state = WAITING
        self.arrival_order = 0
        self.computed = 0
        """Tokens whose KV is in the pool."""
        self.target = 0
        """Tokens to prefill before decoding: prompt + output so far."""
        self.blocks = 0
        self.entry_step = 0
        self.entry_length = 0
        self.residue = 0
        self.first_token_s = -1.0
        self.last_token_s = -1.0
        self.preemptions = 0
        self.recomputed = 0
        self.progress_step = -1
        self.progress_s = 0.0
        """The last step (and its end) in which a batch sequence under the step-shaping
        scheduler got a token or a prefill chunk: what its starvation bound counts from."""

    @property
    def finished(self) -> bool:
        return self.generated >= self.output_tokens


@dataclass
class StepReport:
    """What one step did."""

    seconds: float
    first_tokens: list[Sequence]
    finished: list[Sequence]
    preempted: list[Sequence]
    interactive_gaps: list[float]
    batch_output_tokens: int
    interactive_output_tokens: int
    batch_prefill_tokens: int = 0
    interactive_prefill_tokens: int = 0
    """Prompt tokens computed this step, recomputation included."""
    batch_paused: int = 0
    """Batch sequences the step-shaping scheduler kept resident without a token or a chunk
    this step (paused decoders and partial prefills)."""


class Engine:
    """The simulated engine; the caller owns the clock and passes ``now`` in."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.free_blocks = config.num_blocks
        self.prefix_cache = PrefixCache()
        self.step_index = 0
        self._order = 0
        self._waiting: list[tuple[int, int, int, Sequence]] = []
        self._prefilling: list[Sequence] = []
        self._decoding: dict[int, Sequence] = {}
        self._interactive_decoding: dict[int, Sequence] = {}
        self._finish_heap: list[tuple[int, int, Sequence]] = []
        self._victims: list[tuple[int, int, int, Sequence]] = []
        self._residue_count = [0] * config.block_size
        self._decode_length_sum = 0
        """Sum over decoders of ``entry_length - entry_step``: context = this + n * step."""
        self.running = 0
        self._decode_blocks_granted = False
        """Inside a step, after the decoders' blocks for this step's token were taken: a
        decoder released now also returns the block it was just given."""
        self.interactive_unstarted = 0
        """Interactive sequences waiting or prefilling: their next token is a first token."""
        self.batch_prefill_backlog = 0
        """Prompt tokens batch sequences still have to prefill (waiting or mid-prefill): the
        work a batch admission adds to the coming steps."""
        self.preemptions = 0
        self.recomputed_tokens = 0
        self._last_step_s = 0.0
        """The last step's duration: what the next one is expected to take."""
        self._paused: dict[int, Sequence] = {}
        """Paused batch decoders, oldest progress first (a rider moves to the end)."""
        self._interactive_seen_s = 0.0
        """When interactive work last ran (the whole-step bound's window counts from it; from
        the start, as the engine class's does)."""

    # -- queries -----------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def idle(self) -> bool:
        return not self._waiting and self.running == 0

    def blocks_in_use(self) -> int:
        return self.config.num_blocks - self.free_blocks

    def interactive_pending(self) -> bool:
        """An interactive sequence waits or prefills: its next token is a first token."""
        return self.interactive_unstarted > 0

    def interactive_running(self) -> bool:
        return self.interactive_unstarted > 0 or bool(self._interactive_decoding)

    def schedules_ahead(self, now: float) -> bool:
        """Under async scheduling, whether the step starting ``now`` was scheduled while the one
        before it ran: not when Backfill holds a batch-only step back while interactive work is
        likely (``ahead_while_likely`` off), none being in the engine."""
        sched = self.config.step_schedule
        if sched is None or sched.ahead_while_likely or self.interactive_running():
            return True
        return now - self._interactive_seen_s >= sched.interactive_likely_s

    def interactive_blocks_in_use(self) -> int:
        """Blocks interactive sequences hold now (for the pool-over-time picture)."""
        k, bs = self.step_index, self.config.block_size
        held = sum(s.blocks for s in self._prefilling if s.interactive)
        for s in self._interactive_decoding.values():
            held += -(-(s.entry_length + k - s.entry_step) // bs)
        return held

    def sequences(self) -> Iterator[Sequence]:
        yield from self._prefilling
        yield from self._decoding.values()
        yield from self._paused.values()

    @property
    def paused(self) -> int:
        """Batch decoders paused (resident, carrying no tokens) now."""
        return len(self._paused)

    # -- changes from outside ----------------------------------------------------------------

    def add(self, seq: Sequence, *, requeue: bool = False) -> None:
        """Queue ``seq``; a preempted one (``requeue``) keeps its place by arrival, as vLLM
        puts preempted requests back at the head of their priority."""
        prio = seq.priority if self.config.priority_scheduling else 0
        if not requeue:
            self._order += 1
            seq.arrival_order = self._order
        if seq.interactive:
            self.interactive_unstarted += 1
        seq.state = WAITING
        seq.target = seq.prompt_tokens + seq.generated
        if not seq.interactive:
            self.batch_prefill_backlog += seq.target - seq.computed
        heapq.heappush(self._waiting, (prio, seq.arrival_order, seq.key, seq))

    def abort(self, seq: Sequence) -> int:
        """Stop ``seq`` wherever it is and free its blocks; returns the blocks freed."""
        if seq.state == WAITING:
            self._waiting = [w for w in self._waiting if w[3] is not seq]
            heapq.heapify(self._waiting)
            self._left_unstarted(seq)
            seq.state = ABORTED
            return 0
        if seq.state not in (PREFILL, DECODE, PAUSED):
            return 0
        if seq.state == PREFILL:
            self._left_unstarted(seq)
        freed = self._release(seq)
        seq.state = ABORTED
        return freed

    # -- internals ---------------------------------------------------------------------------

    def _left_unstarted(self, seq: Sequence) -> None:
        """``seq`` leaves waiting or prefill other than by finishing its prefill."""
        if seq.interactive:
            self.interactive_unstarted -= 1
        else:
            self.batch_prefill_backlog -= seq.target - seq.computed

    def _blocks_for(self, tokens: int) -> int:
        return blocks_for(tokens, self.config.block_size)

    def _leave_aggregate(self, seq: Sequence) -> None:
        """Take a decoder out of the aggregate, making its ``computed``, ``generated`` and
        ``blocks`` exact."""
        length = seq.entry_length + self.step_index - seq.entry_step
        seq.generated += self.step_index - seq.entry_step
        seq.computed = length
        seq.blocks = self._blocks_for(length) - seq.shared
        if self._decode_blocks_granted and seq.residue == self.step_index % (
            self.config.block_size
        ):
            seq.blocks += 1
        del self._decoding[seq.key]
        self._interactive_decoding.pop(seq.key, None)
        self._residue_count[seq.residue] -= 1
        self._decode_length_sum -= seq.entry_length - seq.entry_step

    def _release(self, seq: Sequence) -> int:
        """Take a running ``seq`` out of the running set and free its blocks."""
        if seq.state == DECODE:
            self._leave_aggregate(seq)
        elif seq.state == PAUSED:
            del self._paused[seq.key]
        else:
            self._prefilling.remove(seq)
        freed = self._free_blocks_of(seq)
        self.running -= 1
        return freed

    def _free_blocks_of(self, seq: Sequence) -> int:
        """``seq`` gives its blocks back, and leaves the cached prefix it used (freed with its
        last user); returns the blocks freed."""
        freed = seq.blocks
        seq.blocks = 0
        if seq.shared:
            assert seq.prefix is not None
            freed += self.prefix_cache.leave(seq.prefix)
            seq.shared = 0
        self.free_blocks += freed
        return freed

    def _cached_start(self, seq: Sequence) -> int:
        """The prompt tokens ``seq`` would start past on admission: its prefix's, cached."""
        if (
            seq.prefix is None
            or not self.config.prefix_caching
            or self.prefix_cache.cached(seq.prefix) != seq.prefix_blocks
        ):
            return 0
        return seq.prefix_blocks * self.config.block_size

    def _start_on_prefix(self, seq: Sequence, start: int) -> None:
        """``seq``, just admitted, starts past its cached prefix (``start`` > 0)."""
        assert seq.prefix is not None
        self.prefix_cache.join(seq.prefix)
        seq.shared = seq.prefix_blocks
        seq.computed = start
        if not seq.interactive:
            self.batch_prefill_backlog -= start

    def _publish_prefix(self, seq: Sequence) -> None:
        """``seq`` has computed its prefix's blocks: they become the cached, shared copy."""
        if (
            seq.prefix is not None
            and self.config.prefix_caching
            and not seq.shared
            and seq.computed >= seq.prefix_blocks * self.config.block_size
            and self.prefix_cache.publish(seq.prefix, seq.prefix_blocks)
        ):
            seq.blocks -= seq.prefix_blocks
            seq.shared = seq.prefix_blocks

    def _start_running(self, seq: Sequence) -> None:
        seq.state = PREFILL
        seq.computed = 0
        self._prefilling.append(seq)
        self.running += 1
        prio = seq.priority if self.config.priority_scheduling else 0
        heapq.heappush(self._victims, (-prio, -seq.arrival_order, seq.key, seq))

    def _enter_decode(self, seq: Sequence, next_step: int) -> None:
        self._prefilling.remove(seq)
        self._left_unstarted(seq)
        self._join_aggregate(seq, next_step)

    def _join_aggregate(self, seq: Sequence, next_step: int) -> None:
        """``seq`` (``computed`` and ``generated`` exact) decodes from step ``next_step``."""
        if seq.interactive:
            self._interactive_decoding[seq.key] = seq
        seq.state = DECODE
        seq.entry_step = next_step
        seq.entry_length = seq.computed
        seq.residue = (next_step - seq.computed) % self.config.block_size
        self._residue_count[seq.residue] += 1
        self._decode_length_sum += seq.computed - next_step
        self._decoding[seq.key] = seq
        remaining = seq.output_tokens - seq.generated
        heapq.heappush(self._finish_heap, (next_step + remaining, seq.key, seq))

    def _preempt_one(self, report: StepReport) -> bool:
        """Preempt the lowest-priority, latest running sequence (recompute)."""
        while self._victims:
            _, _, _, seq = heapq.heappop(self._victims)
            if seq.state in (PREFILL, DECODE, PAUSED):
                if seq.state == PREFILL:
                    self._left_unstarted(seq)
                self._release(seq)
                seq.recomputed += seq.computed
                self.recomputed_tokens += seq.computed
                seq.preemptions += 1
                self.preemptions += 1
                seq.computed = 0
                report.preempted.append(seq)
                self.add(seq, requeue=True)
                return True
        return False

    # -- the step ----------------------------------------------------------------------------

    def step(self, now: float, *, ahead: bool = False, host_gap_s: float = 0.0) -> StepReport:
        """Schedule and run one step starting at ``now``; returns what happened (its
        ``seconds`` is the step's duration, ``host_gap_s`` of idle device first included; 0
        when there was nothing to run). ``ahead``: it was scheduled while the step before it
        ran (async scheduling), so an arrival during it also waits for the one after."""
        cfg = self.config
        sched = cfg.step_schedule
        report = StepReport(0.0, [], [], [], [], 0, 0)
        k = self.step_index
        budget = cfg.max_num_batched_tokens
        # Backfill's scheduler: batch yields while an interactive sequence waits or prefills.
        holding = sched is not None and self.interactive_unstarted > 0
        present = self.interactive_running()
        if present:
            self._interactive_seen_s = now
        # Idle-ready: interactive work in the engine (none waiting) or right after it, batch
        # sits the step out (the engine class's rule), as while holding: only its starved
        # sequences move.
        idle = (
            sched is not None
            and not holding
            and sits_out(sched, 0.0 if present else now - self._interactive_seen_s)
        )
        yielding = holding or idle
        # The lift: no interactive work for a while, batch prefill is no longer capped.
        lifted = (
            sched is not None
            and sched.lift_cap_after_s > 0
            and not present
            and now - self._interactive_seen_s >= sched.lift_cap_after_s
        )
        # The whole-step bound: interactive runs or is likely, none waits: batch decoders take
        # turns within the step target (paused, the ones in turn ride along).
        bounded = (
            sched is not None
            and not yielding
            and not lifted
            and now - self._interactive_seen_s < sched.interactive_likely_s
        )
        target = 0.0
        if sched is not None:
            target = sched.chunk_target_s / (2 if ahead else 1)
            if lifted:
                target = sched.lifted_step_target_s or math.inf
        if yielding or bounded:
            if len(self._decoding) > len(self._interactive_decoding):
                self._pause_batch(now)
        elif self._paused:
            self._resume_batch()
        # Decoders first: one token each, and a block for those at a block boundary.
        need = self._residue_count[k % cfg.block_size] if self._decoding else 0
        while need > self.free_blocks and self._decoding:
            if not self._preempt_one(report):
                break
            need = self._residue_count[k % cfg.block_size]
        self.free_blocks -= need
        self._decode_blocks_granted = True
        budget -= len(self._decoding)
        riders: list[Sequence] = []
        batch_s = target
        if yielding and self._paused:
            # Paused decoders at their starvation bound carry a token, before anything else.
            budget, _ = self._take_riders(riders, budget, now, None)
        elif bounded and self._paused:
            # Decoders first, in turns, as many as the target holds; prefill gets the rest.
            budget, batch_s = self._take_riders(riders, budget, now, target)
        # Partial prefills, in the order they started, then waiting sequences by priority.
        chunks: list[tuple[Sequence, int]] = []
        prefill_tokens = 0
        attention = 0.0
        preempted_now = bool(report.preempted)
        batch_chunked = False
        # While holding, batch prefills at their starvation bound go before interactive ones:
        # the bound is a promise, and the chunk cap keeps what it costs short.
        order = (
            sorted(self._prefilling, key=lambda s: s.interactive)
            if yielding
            else list(self._prefilling)
        )
        for seq in order:
            if budget <= 0:
                break
            if seq.state != PREFILL:
                continue
            chunk = min(seq.target - seq.computed, budget)
            capped = sched is not None and not seq.interactive
            if capped:
                assert sched is not None
                if yielding and not starved(
                    sched, seq.progress_step, seq.progress_s, k, now, self._last_step_s
                ):
                    report.batch_paused += 1
                    continue
                if batch_chunked and batch_s <= 0:
                    continue  # the cap is spent
                chunk = self._batch_chunk(seq.computed, batch_s, chunk, batch_chunked)
                if chunk == 0:
                    continue
            extra = self._blocks_for(seq.computed + chunk) - seq.blocks - seq.shared
            while extra > self.free_blocks:
                preempted_now = True
                if not self._preempt_one(report) or seq.state != PREFILL:
                    break
            if seq.state != PREFILL or extra > self.free_blocks:
                continue
            self._grant(seq, extra)
            chunks.append((seq, chunk))
            budget -= chunk
            prefill_tokens += chunk
            attention += prefill_attention(seq.computed, chunk)
            if capped:
                batch_s -= prefill_seconds(cfg.cost, seq.computed, chunk)
                batch_chunked = True
        while budget > 0 and self._waiting:
            seq = self._waiting[0][3]
            # Under Backfill's scheduler interactive work may take room from batch; vLLM
            # admits no new request in a step that had to preempt.
            for_interactive = sched is not None and seq.interactive
            if preempted_now and not for_interactive:
                break
            if self.running >= cfg.max_num_seqs and not (
                for_interactive and self._preempt_batch(report)
            ):
                break
            if self.running >= cfg.max_num_seqs:
                continue
            start = self._cached_start(seq)
            chunk = min(seq.target - start, budget)
            capped = sched is not None and not seq.interactive
            if capped:
                if yielding:
                    break
                chunk = self._batch_chunk(start, batch_s, chunk, batch_chunked)
                if chunk == 0:
                    break
            blocks = self._blocks_for(start + chunk) - start // cfg.block_size
            while blocks > self.free_blocks and for_interactive and self._preempt_batch(report):
                pass
            if blocks > self.free_blocks:
                break
            heapq.heappop(self._waiting)
            self._start_running(seq)
            if start:
                self._start_on_prefix(seq, start)
            self._grant(seq, blocks)
            chunks.append((seq, chunk))
            budget -= chunk
            prefill_tokens += chunk
            attention += prefill_attention(start, chunk)
            if capped:
                batch_s -= prefill_seconds(cfg.cost, start, chunk)
                batch_chunked = True
        n_decode = len(self._decoding)
        if holding and sched is not None and sched.ride_along_share > 0 and self._paused:
            # Batch decoders may ride along up to a share of what the step costs without them.
            alive = [r for r in riders if r.state == PAUSED]
            base = cfg.cost.step_seconds(
                StepWork(
                    prefill_tokens,
                    attention,
                    n_decode + len(alive),
                    self._decode_length_sum + n_decode * k + sum(r.computed for r in alive),
                )
            )
            budget, _ = self._take_riders(riders, budget, now, sched.ride_along_share * base)
        riders = [r for r in riders if r.state == PAUSED]
        report.batch_paused += len(self._paused) - len(riders)
        if n_decode == 0 and not chunks and not riders:
            self._decode_blocks_granted = False
            return report
        context = self._decode_length_sum + n_decode * k + sum(r.computed for r in riders)
        work = StepWork(prefill_tokens, attention, n_decode + len(riders), context)
        report.seconds = host_gap_s + cfg.cost.step_seconds(work)
        self._last_step_s = report.seconds
        end = now + report.seconds
        self._finish_step(report, chunks, n_decode, end)
        self._finish_riders(report, riders, end)
        return report

    # -- Backfill's step-shaping scheduler ---------------------------------------------------

    def wake_s(self, now: float) -> float | None:
        """With batch sitting out (idle-ready) and nothing to run, when it may move again
        without an arrival: the window's end or a paused sequence's starvation bound, whichever
        is first (never sooner than a millisecond on); None when batch is not sitting out."""
        sched = self.config.step_schedule
        if sched is None or sched.idle_ready_s <= 0 or self.interactive_running():
            return None  # interactive work runs: the engine is not idle
        # (A nanosecond on: seen + window - seen may round below the window.)
        end = self._interactive_seen_s + sched.idle_ready_s + 1e-9
        if end <= now:
            return None
        if sched.starvation_s > 0:
            batch = [s for s in self._prefilling if not s.interactive]
            batch += list(self._paused.values())
            if batch:
                oldest = min(s.progress_s for s in batch)
                end = min(end, oldest + sched.starvation_s - 2 * self._last_step_s + 1e-6)
        return max(end, now + 1e-3)

    def _pause_batch(self, now: float) -> None:
        """Batch decoders leave the aggregate and stay resident, carrying no tokens."""
        k = self.step_index
        for seq in [s for s in self._decoding.values() if not s.interactive]:
            self._leave_aggregate(seq)
            seq.state = PAUSED
            # Every aggregate decoder got its last token in the step before this one.
            seq.progress_step = k - 1
            seq.progress_s = now
            self._paused[seq.key] = seq

    def _resume_batch(self) -> None:
        k = self.step_index
        for seq in self._paused.values():
            self._join_aggregate(seq, k)
        self._paused.clear()

    def _take_riders(
        self, riders: list[Sequence], budget: int, now: float, allowance_s: float | None
    ) -> tuple[int, float]:
        """Paused decoders, oldest progress first, that carry a token this step: with
        ``allowance_s`` None those at their starvation bound, else as many as fit in that
        much step time. Returns the token budget and the step time left."""
        sched = self.config.step_schedule
        assert sched is not None
        cost = self.config.cost
        k, bs = self.step_index, self.config.block_size
        taken = {r.key for r in riders}
        for seq in self._paused.values():
            if budget <= 0:
                break
            if seq.key in taken:
                continue
            if allowance_s is None:
                if not starved(sched, seq.progress_step, seq.progress_s, k, now, self._last_step_s):
                    break
            else:
                price = decode_token_seconds(cost, seq.computed)
                if price > allowance_s:
                    break
                allowance_s -= price
            extra = 1 if seq.computed % bs == 0 else 0
            if extra > self.free_blocks:
                continue  # batch takes no block from a short pool
            self._grant(seq, extra)
            riders.append(seq)
            budget -= 1
        return budget, allowance_s if allowance_s is not None else 0.0

    def _finish_riders(self, report: StepReport, riders: list[Sequence], end: float) -> None:
        k = self.step_index - 1
        for seq in riders:
            seq.computed += 1
            seq.generated += 1
            seq.last_token_s = end
            report.batch_output_tokens += 1
            del self._paused[seq.key]
            if seq.finished:
                self._free_blocks_of(seq)
                self.running -= 1
                seq.state = DONE
                report.finished.append(seq)
                continue
            seq.progress_step = k
            seq.progress_s = end
            self._paused[seq.key] = seq  # to the end: the most recent progress

    def _batch_chunk(self, start: int, seconds: float, limit: int, chunked: bool) -> int:
        """A batch prefill chunk within the step time left to batch prefill; the first one
        in a step gets at least one token, so batch always moves."""
        n = chunk_tokens(self.config.cost, start, seconds, limit)
        return n if n > 0 or chunked else min(1, limit)

    def _preempt_batch(self, report: StepReport) -> bool:
        """Interactive work is short of room: the latest batch sequence gives its blocks up
        (recompute later). False when no batch sequence runs."""
        victims = self._victims
        while victims and victims[0][3].state not in (PREFILL, DECODE, PAUSED):
            heapq.heappop(victims)
        if not victims or victims[0][3].interactive:
            return False
        return self._preempt_one(report)

    def _grant(self, seq: Sequence, blocks: int) -> None:
        self.free_blocks -= blocks
        seq.blocks += blocks

    def _finish_step(
        self, report: StepReport, chunks: list[tuple[Sequence, int]], n_decode: int, end: float
    ) -> None:
        for seq in self._interactive_decoding.values():
            report.interactive_gaps.append(end - seq.last_token_s)
            seq.last_token_s = end
        n_interactive = len(self._interactive_decoding)
        report.interactive_output_tokens += n_interactive
        report.batch_output_tokens += n_decode - n_interactive
        self.step_index += 1
        self._decode_blocks_granted = False
        k = self.step_index
        # Decoders generated one token each; those done leave (their last token was this step).
        heap = self._finish_heap
        while heap and heap[0][0] <= k:
            due, _, seq = heapq.heappop(heap)
            # A preempted sequence's old entry is stale: its due step no longer matches.
            if seq.state == DECODE and due == seq.entry_step + seq.output_tokens - seq.generated:
                self._complete(seq, report)
        for seq, chunk in chunks:
            if seq.interactive:
                report.interactive_prefill_tokens += chunk
            else:
                report.batch_prefill_tokens += chunk
            if seq.state != PREFILL:
                continue
            seq.computed += chunk
            self._publish_prefix(seq)
            if not seq.interactive:
                self.batch_prefill_backlog -= chunk
                seq.progress_step = k - 1
                seq.progress_s = end
            if seq.computed < seq.target:
                continue
            # The step that completes a prefill samples the next token.
            seq.generated += 1
            if seq.first_token_s < 0:
                seq.first_token_s = end
                report.first_tokens.append(seq)
            seq.last_token_s = end
            if seq.interactive:
                report.interactive_output_tokens += 1
            else:
                report.batch_output_tokens += 1
            if seq.finished:
                self._left_unstarted(seq)
                self._prefilling.remove(seq)
                self._free_blocks_of(seq)
                self.running -= 1
                seq.state = DONE
                report.finished.append(seq)
            else:
                self._enter_decode(seq, k)

    def _complete(self, seq: Sequence, report: StepReport) -> None:
        self._release(seq)
        seq.state = DONE
        report.finished.append(seq)
