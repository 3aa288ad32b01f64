"""The step scheduler's parts split out of ``backfill_vllm/scheduler.py`` that import no vLLM:
what it remembers of batch requests and records of each step (``tracks``), the steps in flight
(``stepmodel.StepsInFlight``), vLLM's waiting queues as it borrows them (``queues``) and its KV
block arithmetic (``kvblocks``). The scheduler over vLLM is tested in ``backfill_vllm/tests``
(tests/e2e/test_step_scheduler_unit.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from backfill_vllm.kvblocks import blocks_to_start, cdiv
from backfill_vllm.metrics import SchedulerMetrics
from backfill_vllm.policy import StepPlan
from backfill_vllm.queues import put_back, set_aside, waiting_interactive
from backfill_vllm.stepmodel import StepsInFlight, StepTimeModel
from backfill_vllm.tracks import BatchTracks

BATCH = 10


def plan(paused: Iterable[str] = (), *, held_back: bool = False) -> StepPlan:
    return StepPlan(
        holding=True,
        paused=frozenset(paused),
        relieved=frozenset(),
        riding=frozenset(),
        chunk_cap=64,
        prefill_allowance=0,
        admit_batch=False,
        held_tokens=3,
        held_back=held_back,
    )


def test_a_pause_is_counted_once_and_its_steps_each_step_until_the_request_moves() -> None:
    metrics = SchedulerMetrics("v", "vllm", BATCH)
    tracks = BatchTracks(metrics)
    tracks.arrived("b", 0.0)
    model = StepTimeModel()
    for now in (1.0, 2.0, 3.0):
        tracks.account(plan({"b"}), {}, lambda _: True, (1, 1), 0, model, now)
    track = tracks.get("b")
    assert track is not None
    assert (track.pauses, track.paused_steps, track.pause_started_s) == (1, 3, 1.0)
    assert (metrics.pauses, metrics.paused_steps, metrics.longest_pause_steps) == (1, 3, 3)
    assert metrics.tokens_held == 9
    tracks.account(plan(), {"b": 1}, lambda _: True, (1, 1), 0, model, 4.0)
    assert (track.paused_steps, track.pause_started_s, track.last_progress_s) == (0, None, 4.0)
    assert metrics.batch_requests == 1


def test_a_request_preempted_within_the_step_is_waiting_not_paused() -> None:
    metrics = SchedulerMetrics("v", "vllm", BATCH)
    tracks = BatchTracks(metrics)
    tracks.arrived("b", 0.0)
    tracks.account(plan({"b"}), {}, lambda _: False, (0, 0), 0, StepTimeModel(), 1.0)
    assert metrics.pauses == 0
    assert metrics.paused_now == 0


def test_a_held_back_step_counts_and_pauses_nobody() -> None:
    metrics = SchedulerMetrics("v", "vllm", BATCH)
    tracks = BatchTracks(metrics)
    tracks.arrived("b", 0.0)
    tracks.account(plan({"b"}, held_back=True), {}, lambda _: True, (1, 1), 0, StepTimeModel(), 1)
    assert (metrics.steps, metrics.held_back_steps, metrics.pauses) == (1, 1, 0)


def test_preemptions_are_counted_by_reason_and_end_a_pause_and_freeing_forgets() -> None:
    metrics = SchedulerMetrics("v", "vllm", BATCH)
    tracks = BatchTracks(metrics)
    tracks.arrived("b", 0.0)
    tracks.account(plan({"b"}), {}, lambda _: True, (1, 1), 0, StepTimeModel(), 1.0)
    tracks.preempted("b", "seqs")
    tracks.preempted("b", "kv")
    track = tracks.get("b")
    assert track is not None
    assert (track.paused_steps, track.pause_started_s) == (0, None)
    assert (metrics.preemptions_seqs, metrics.preemptions_kv) == (1, 1)
    tracks.freed("b")
    assert "b" not in tracks


def test_a_step_queued_behind_another_runs_from_when_that_one_came_back() -> None:
    steps = StepsInFlight()
    steps.sent(1, 10.0, 100, 2)
    steps.sent(2, 10.1, 50, 1)
    assert steps
    assert steps.came_back(1, 10.5) == (100, 0.5, 2)
    back = steps.came_back(2, 10.7)
    assert back is not None
    assert back[0] == 50
    assert abs(back[1] - 0.2) < 1e-9
    assert steps.last_step_s == back[1]
    assert not steps


def test_a_step_older_than_one_that_came_back_never_will() -> None:
    steps = StepsInFlight()
    steps.sent(1, 0.0, 10, 0)
    steps.sent(2, 1.0, 10, 0)
    assert steps.came_back(2, 2.0) is not None
    assert not steps
    assert steps.came_back(1, 3.0) is None


@dataclass
class Req:
    request_id: str
    priority: int


@dataclass
class Queue:
    """vLLM's RequestQueue as the scheduler uses it, kept in priority order."""

    requests: list[Req] = field(default_factory=list)

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self.requests))

    def __bool__(self) -> bool:
        return bool(self.requests)

    def peek_request(self) -> Req:
        return self.requests[0]

    def remove_requests(self, gone: list[Req]) -> None:
        self.requests = [r for r in self.requests if r not in gone]

    def add_request(self, request: Req) -> None:
        self.requests.append(request)
        self.requests.sort(key=lambda r: r.priority)


def test_waiting_batch_is_set_aside_for_a_step_but_those_kept_and_put_back() -> None:
    holding, waiting = (
        Queue([Req("kb", BATCH)]),
        Queue([Req("i", 0), Req("a", BATCH), Req("k", 11)]),
    )
    aside = set_aside(holding, waiting, BATCH, frozenset({"k"}))
    assert [r.request_id for r in holding] == []
    assert [r.request_id for r in waiting] == ["i", "k"]
    put_back(aside)
    assert [r.request_id for r in holding] == ["kb"]
    assert [r.request_id for r in waiting] == ["i", "a", "k"]


def test_waiting_interactive_comes_in_admission_order_and_stops_at_batch_when_ordered() -> None:
    holding = Queue([Req("h", 0)])
    waiting = Queue([Req("i1", 0), Req("i2", 1), Req("b", BATCH), Req("late", 0)])
    seen: list[tuple[str, bool]] = []

    def startable(request: Req, kv_holding: bool) -> bool:
        seen.append((request.request_id, kv_holding))
        return request.request_id != "i2"

    found = waiting_interactive(holding, waiting, BATCH, True, startable)
    assert [r.request_id for r in found] == ["h", "i1"]
    assert seen == [("h", True), ("i1", False), ("i2", False)]
    unordered = waiting_interactive(holding, waiting, BATCH, False, lambda r, k: True)
    assert [r.request_id for r in unordered] == ["h", "i1", "i2", "late"]


def test_blocks_to_start_a_request_count_its_chunk_and_lookahead_in_every_group() -> None:
    assert cdiv(33, 16) == 3
    assert cdiv(32, 16) == 2
    # 20 computed (2 blocks of 16 held), 30 more and 2 lookahead slots: 52 tokens, 4 blocks.
    assert blocks_to_start(20, 30, 2, 4096, 16, 1) == 2
    assert blocks_to_start(20, 30, 2, 4096, 16, 3) == 6
    # Never past the model's length; never negative.
    assert blocks_to_start(0, 100, 0, 40, 16, 1) == 3
    assert blocks_to_start(48, 0, 0, 4096, 16, 1) == 0
