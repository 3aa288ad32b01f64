"""Where an interactive request's time to its first token goes inside the engine, split in
three parts recorded in :class:`~backfill_vllm.metrics.SchedulerMetrics`:

- **step in flight**: from its arrival to the end of the step that was running when it
  arrived (0 when the engine was between steps or idle);
- **queueing**: from then until the step carrying its first prompt chunk starts running (the
  further steps it waited through: a step already scheduled ahead under async scheduling, steps
  its prompt did not fit in, a hold);
- **prefill**: from that start to the end of the step that gave its first token (every chunk
  of its prompt, and any step between them).

The three add up to its arrival-to-first-token time in the engine core (one preempted between
its first chunk and its first token counts its wait for readmission as prefill). Its arrival is when
vLLM's front end took it (``Request.arrival_time``, wall clock), not when the core's
``add_request`` saw it: a synchronous engine core takes new requests only between steps, so
the wait for the step in flight happens before ``add_request``. A front-end arrival more than
``MAX_FRONT_END_S`` before ``add_request`` (or after it) is not believed; ``add_request``'s
time is used then.

Nothing here imports vLLM: the scheduler tells it what happened (an interactive request added,
scheduled, a step back, a first token, a request freed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from backfill_vllm.metrics import SchedulerMetrics

MAX_FRONT_END_S = 30.0
"""A front-end arrival older than this at ``add_request`` is taken as a clock it cannot be
compared with (a test's synthetic arrival, a clock step)."""

RECENT_STEPS = 16
"""Step run intervals remembered to place an arrival that came before ``add_request``."""


@dataclass(frozen=True, slots=True)
class TtftSplit:
    """One interactive request's first-token time in the engine, in its three parts."""

    in_flight_s: float
    queueing_s: float
    prefill_s: float

    @property
    def total_s(self) -> float:
        return self.in_flight_s + self.queueing_s + self.prefill_s


@dataclass
class _Pending:
    arrived_s: float
    in_flight_s: float | None = None
    """None while the step in flight at its arrival has not come back."""
    first_step: int | None = None
    """The key of the step that carried its first prompt chunk."""
    scheduled_s: float | None = None
    started_s: float | None = None
    """When that step started running (it came back)."""


def core_arrival(add_s: float, wall_now: float, arrival_wall: float) -> float:
    """The monotonic time of a request vLLM's front end took at ``arrival_wall`` (wall clock),
    seen by ``add_request`` at ``add_s`` (monotonic) and ``wall_now`` (wall clock)."""
    before = wall_now - arrival_wall
    if 0.0 <= before <= MAX_FRONT_END_S:
        return add_s - before
    return add_s


class TtftSplits:
    """The interactive requests waiting for their first token, and the steps they met."""

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self.metrics = metrics
        self._pending: dict[str, _Pending] = {}
        self._recent: deque[tuple[float, float]] = deque(maxlen=RECENT_STEPS)
        """Run intervals (start, end) of the steps that came back last."""
        self.last: TtftSplit | None = None
        """The last split recorded (for tests and logs)."""
        self._last_back_s: float | None = None

    def __bool__(self) -> bool:
        return bool(self._pending)

    def arrived(self, request_id: str, arrived_s: float, steps_in_flight: bool) -> None:
        """An interactive request the engine had not seen, taken at ``arrived_s``; whether
        steps it has not seen come back are in flight now."""
        pending = _Pending(arrived_s)
        for start, end in reversed(self._recent):
            if start <= arrived_s < end:
                pending.in_flight_s = end - arrived_s
                break
            if end <= arrived_s:
                break
        if pending.in_flight_s is None and not steps_in_flight:
            pending.in_flight_s = 0.0
        self._pending[request_id] = pending

    def scheduled(self, request_ids: Iterable[str], key: int, now: float) -> None:
        """A step (``key``) scheduled at ``now`` with tokens for ``request_ids``."""
        for request_id in request_ids:
            pending = self._pending.get(request_id)
            if pending is not None and pending.first_step is None:
                pending.first_step, pending.scheduled_s = key, now

    def came_back(self, key: int, started_s: float | None, ended_s: float) -> None:
        """The step ``key`` came back at ``ended_s``, having run from ``started_s`` (None: not
        known; its schedule time stands in)."""
        self._last_back_s = ended_s
        if started_s is not None:
            self._recent.append((started_s, ended_s))
        for pending in self._pending.values():
            # A step not known to have run (an empty one) tells nothing of the one in flight.
            if pending.in_flight_s is None and started_s is not None:
                met = started_s <= pending.arrived_s < ended_s
                pending.in_flight_s = ended_s - pending.arrived_s if met else 0.0
            if pending.first_step == key and pending.started_s is None:
                start = started_s if started_s is not None else pending.scheduled_s
                pending.started_s = start if start is not None else ended_s

    def waiting_first_token(self) -> list[str]:
        """The requests whose first prompt chunk has been through a step."""
        return [r for r, p in self._pending.items() if p.started_s is not None]

    def first_token(self, request_id: str, now: float) -> TtftSplit | None:
        """``request_id`` got its first token from the step that came back at ``now``."""
        pending = self._pending.pop(request_id, None)
        if pending is None or pending.started_s is None:
            return None
        arrived = min(pending.arrived_s, pending.started_s)
        started = max(pending.started_s, arrived)
        in_flight = min(pending.in_flight_s or 0.0, started - arrived)
        split = TtftSplit(in_flight, started - arrived - in_flight, max(0.0, now - started))
        self.last = split
        with self.metrics.lock:
            self.metrics.ttft_split.observe(split.in_flight_s, split.queueing_s, split.prefill_s)
        return split

    def freed(self, request_id: str, got_token: bool) -> None:
        """vLLM freed ``request_id``: one that finished with its first token (in the step that
        came back last) is counted; one aborted before it is not."""
        if request_id not in self._pending:
            return
        if got_token and self._last_back_s is not None:
            self.first_token(request_id, self._last_back_s)
        else:
            self._pending.pop(request_id, None)
