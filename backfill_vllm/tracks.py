"""What the step scheduler remembers of each batch request between steps, and what it records
of each step in :class:`~backfill_vllm.metrics.SchedulerMetrics`: when a batch request last
made progress, how long it has been paused (what :func:`backfill_vllm.policy.plan_step` reads
for its starvation bound), its pauses and preemptions. Nothing here imports vLLM: the scheduler
tells it what happened (a request added, preempted, freed; a step planned and scheduled).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

from backfill_vllm.metrics import SchedulerMetrics
from backfill_vllm.policy import StepPlan
from backfill_vllm.stepmodel import StepTimeModel


@dataclass
class BatchTrack:
    """What the scheduler remembers of one batch request between steps."""

    last_progress_s: float
    paused_steps: int = 0
    pause_started_s: float | None = None
    pauses: int = 0


class BatchTracks:
    """Every batch request's :class:`BatchTrack`, by request id, from its arrival until vLLM
    frees it, and the metrics they feed."""

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self.metrics = metrics
        self._tracks: dict[str, BatchTrack] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._tracks

    def get(self, request_id: str) -> BatchTrack | None:
        return self._tracks.get(request_id)

    def arrived(self, request_id: str, now: float) -> None:
        """A batch request the engine had not seen."""
        self._tracks[request_id] = BatchTrack(now)
        with self.metrics.lock:
            self.metrics.batch_requests += 1

    def preempted(self, request_id: str, reason: str) -> None:
        """A batch request preempted (``seqs``: for a sequence slot; else for KV blocks):
        waiting again, not paused."""
        with self.metrics.lock:
            if reason == "seqs":
                self.metrics.preemptions_seqs += 1
            else:
                self.metrics.preemptions_kv += 1
        track = self._tracks.get(request_id)
        if track is not None:
            track.paused_steps, track.pause_started_s = 0, None

    def freed(self, request_id: str) -> None:
        """A request vLLM has freed (finished or aborted): nothing more to remember."""
        self._tracks.pop(request_id, None)

    def account(
        self,
        plan: StepPlan,
        scheduled: Collection[str],
        running: Callable[[str], bool],
        resident: tuple[int, int],
        capped: int,
        step_model: StepTimeModel,
        now: float,
    ) -> None:
        """Record one step: ``plan`` as planned, ``scheduled`` the requests vLLM gave tokens,
        ``running(id)`` whether a request is still in vLLM's running set (one it preempted in
        the step is waiting, not paused), ``resident`` the batch requests running and
        decoding, ``capped`` the prefill tokens the chunk cap kept out."""
        m = self.metrics
        with m.lock:
            m.steps += 1
            if plan.held_back:
                # Nobody was paused: the step in flight carries them.
                m.held_back_steps += 1
                return
            m.lifted_steps += plan.lifted
            m.bounded_steps += plan.bounded
            m.tokens_capped += capped
            m.chunk_cap = plan.chunk_cap
            m.fit = step_model.fit()
            m.step_outliers = step_model.outliers
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
                if not running(request_id):
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
