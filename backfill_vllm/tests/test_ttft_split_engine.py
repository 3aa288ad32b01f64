"""BackfillScheduler records where each interactive request's first-token time goes (step in
flight, queueing, prefill) on its metrics endpoint, driven with vLLM's real scheduler code and
synthetic requests (see ``test_scheduler``). What is scheduled does not change."""

from __future__ import annotations

import time
import unittest

from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from backfill_vllm.settings import SchedulerSettings
from backfill_vllm.tests.helpers import (
    BATCH,
    INTERACTIVE,
    TOKEN,
    engine_core,
    make_request,
    make_scheduler,
    run_step,
)

PARTS = ("step_in_flight", "queueing", "prefill")
GAP_S = 0.01
"""Spacing put between a step's schedule, an arrival and the step's return, so the arrival
falls inside the step whatever the clocks' resolution (a sleep, not a bound)."""


def split(scheduler) -> dict[str, tuple[float, float]]:
    """Each part's (sum, count) as the metrics endpoint serves them."""
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(scheduler.backfill_metrics.render()):
        for sample in family.samples:
            got[sample.name] = sample.value
    out = {}
    for part in PARTS:
        name = f"backfill_sched_interactive_{part}_seconds"
        out[part] = (got.get(f"{name}_sum", -1.0), got.get(f"{name}_count", -1.0))
    return out


def feed(scheduler, output) -> None:
    """Return ``output`` from the model as :func:`run_step` does."""
    ids = list(output.num_scheduled_tokens)
    requests = scheduler.requests
    scheduler.update_from_output(
        output,
        ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: n for n, r in enumerate(ids)},
            sampled_token_ids=[[] if requests[i].is_prefill_chunk else [TOKEN] for i in ids],
        ),
    )


def start_batch(scheduler, n: int = 3) -> list:
    batch = [make_request(f"b{k}", prompt=40, priority=BATCH, max_tokens=30) for k in range(n)]
    for r in batch:
        scheduler.add_request(r)
    for _ in range(20):
        run_step(scheduler)
    return batch


def until_first_token(scheduler, request) -> None:
    for _ in range(50):
        if request.num_output_tokens > 0 or request.is_finished():
            return
        run_step(scheduler)
    raise AssertionError("no first token")


class TtftSplitInTheEngine(unittest.TestCase):
    def test_an_arrival_during_a_step_waits_for_it_as_step_in_flight(self) -> None:
        s = make_scheduler(budget=128)
        start_batch(s)
        output = s.schedule()
        time.sleep(GAP_S)
        arrival = time.time()  # vLLM's front end took it while the step ran
        time.sleep(GAP_S)
        feed(s, output)
        i = make_request("i", prompt=300, priority=INTERACTIVE, max_tokens=4, arrival=arrival)
        s.add_request(i)
        until_first_token(s, i)
        got = split(s)
        self.assertEqual({p: got[p][1] for p in PARTS}, dict.fromkeys(PARTS, 1.0))
        self.assertGreater(got["step_in_flight"][0], 0.0)
        self.assertGreaterEqual(got["queueing"][0], 0.0)
        self.assertGreater(got["prefill"][0], 0.0)

    def test_batch_is_not_counted_and_an_idle_engine_has_no_step_in_flight(self) -> None:
        s = make_scheduler(budget=128)
        i = make_request("i", prompt=300, priority=INTERACTIVE, max_tokens=4, arrival=time.time())
        s.add_request(i)
        until_first_token(s, i)  # three chunks of prefill
        self.assertEqual(split(s)["step_in_flight"], (0.0, 1.0))
        start_batch(s)
        while s.has_unfinished_requests():
            run_step(s)
        got = split(s)
        self.assertEqual({p: got[p][1] for p in PARTS}, dict.fromkeys(PARTS, 1.0))

    def test_one_aborted_before_its_first_token_is_not_counted(self) -> None:
        s = make_scheduler(budget=64)
        i = make_request("i", prompt=300, priority=INTERACTIVE, max_tokens=4, arrival=time.time())
        s.add_request(i)
        run_step(s)
        s.finish_requests("i", RequestStatus.FINISHED_ABORTED)
        j = make_request("j", prompt=20, priority=INTERACTIVE, max_tokens=1, arrival=time.time())
        s.add_request(j)  # finished (and freed) in the step of its first token
        until_first_token(s, j)
        self.assertTrue(j.is_finished())
        self.assertEqual(split(s)["prefill"][1], 1.0)

    def test_under_async_scheduling_an_arrival_mid_step_waits_for_it(self) -> None:
        # Batch steps scheduled ahead (the class's default holds them back while interactive
        # work is likely, and the step in flight would be an empty one).
        ahead = SchedulerSettings(ahead_while_likely=True)
        s = make_scheduler(async_scheduling=True, max_num_seqs=32, budget=256, settings=ahead)
        core = engine_core(s)
        for k in range(4):
            s.add_request(make_request(f"b{k}", prompt=8, priority=BATCH, max_tokens=60))
        for _ in range(10):
            core.step_with_batch_queue()
        self.assertTrue(s._steps)  # a step with tokens is in flight
        i = make_request("i", prompt=8, priority=INTERACTIVE, max_tokens=4, arrival=time.time())
        s.add_request(i)
        time.sleep(GAP_S)
        for _ in range(20):
            if i.num_output_tokens > 0:
                break
            core.step_with_batch_queue()
        got = split(s)
        self.assertEqual(got["step_in_flight"][1], 1.0)
        self.assertGreater(got["step_in_flight"][0], 0.0)


if __name__ == "__main__":
    unittest.main()
