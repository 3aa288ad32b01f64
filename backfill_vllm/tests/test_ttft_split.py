"""The split of an interactive request's first-token time (``backfill_vllm.ttftsplit``), with
the times given: no vLLM, no clock."""

from __future__ import annotations

import unittest

from backfill_vllm.metrics import SchedulerMetrics
from backfill_vllm.ttftsplit import MAX_FRONT_END_S, TtftSplit, TtftSplits, core_arrival


def splits() -> TtftSplits:
    return TtftSplits(SchedulerMetrics("test", "0", 10))


def close(test: unittest.TestCase, got: TtftSplit | None, *want: float) -> None:
    test.assertIsNotNone(got)
    assert got is not None
    for value, expected in zip((got.in_flight_s, got.queueing_s, got.prefill_s), want, strict=True):
        test.assertAlmostEqual(value, expected, places=9)


class Split(unittest.TestCase):
    def test_a_synchronous_core_sees_the_arrival_after_the_step_it_waited_for(self) -> None:
        t = splits()
        t.came_back(1, 10.0, 10.5)  # a step ran 10.0-10.5; the request came at 10.2
        t.arrived("i", 10.2, steps_in_flight=False)
        t.scheduled(["i"], 2, 10.51)
        t.came_back(2, 10.51, 10.8)
        self.assertEqual(t.waiting_first_token(), ["i"])
        close(self, t.first_token("i", 10.8), 0.3, 0.01, 0.29)

    def test_an_arrival_between_steps_met_no_step(self) -> None:
        t = splits()
        t.came_back(1, 10.0, 10.5)
        t.arrived("i", 10.6, steps_in_flight=False)
        t.scheduled(["i"], 2, 10.7)
        t.came_back(2, 10.7, 11.0)
        close(self, t.first_token("i", 11.0), 0.0, 0.1, 0.3)

    def test_under_async_scheduling_the_step_queued_behind_is_queueing(self) -> None:
        t = splits()
        # Step 1 runs from 10.0; step 2 is scheduled ahead at 10.1; the request comes at 10.2.
        t.arrived("i", 10.2, steps_in_flight=True)
        t.came_back(1, 10.0, 10.5)
        t.scheduled(["i"], 3, 10.55)
        t.came_back(2, 10.5, 10.9)
        t.came_back(3, 10.9, 11.2)
        close(self, t.first_token("i", 11.2), 0.3, 0.4, 0.3)

    def test_a_prefill_in_chunks_counts_every_chunk_step(self) -> None:
        t = splits()
        t.arrived("i", 1.0, steps_in_flight=False)
        t.scheduled(["i"], 1, 1.0)
        t.came_back(1, 1.0, 1.2)
        t.scheduled(["i"], 2, 1.2)  # not its first step: the first one stands
        t.came_back(2, 1.2, 1.5)
        close(self, t.first_token("i", 1.5), 0.0, 0.0, 0.5)

    def test_it_is_recorded_in_the_metrics_and_served(self) -> None:
        t = splits()
        t.came_back(1, 0.0, 1.0)
        t.arrived("i", 0.5, steps_in_flight=False)
        t.scheduled(["i"], 2, 1.0)
        t.came_back(2, 1.0, 3.0)
        t.first_token("i", 3.0)
        text = t.metrics.render()
        self.assertIn("backfill_sched_interactive_step_in_flight_seconds_sum 0.5", text)
        self.assertIn("backfill_sched_interactive_queueing_seconds_sum 0.0", text)
        self.assertIn("backfill_sched_interactive_prefill_seconds_sum 2.0", text)
        self.assertIn("backfill_sched_interactive_prefill_seconds_count 1.0", text)
        self.assertIn('backfill_sched_interactive_prefill_seconds_bucket{le="2.5"} 1.0', text)
        self.assertIn('backfill_sched_interactive_prefill_seconds_bucket{le="1.0"} 0.0', text)

    def test_aborted_before_its_first_token_it_is_not_counted(self) -> None:
        t = splits()
        t.arrived("i", 1.0, steps_in_flight=False)
        t.scheduled(["i"], 1, 1.0)
        t.freed("i", got_token=False)
        t.came_back(1, 1.0, 1.2)
        self.assertIsNone(t.first_token("i", 1.2))
        self.assertEqual(t.metrics.ttft_split.count, 0)
        self.assertFalse(t)

    def test_finished_with_its_first_token_it_is_counted_when_freed(self) -> None:
        t = splits()
        t.arrived("i", 1.0, steps_in_flight=False)
        t.scheduled(["i"], 1, 1.1)
        t.came_back(1, 1.1, 1.4)
        t.freed("i", got_token=True)
        close(self, t.last, 0.0, 0.1, 0.3)
        self.assertEqual(t.metrics.ttft_split.count, 1)

    def test_an_empty_step_coming_back_tells_nothing_of_the_step_in_flight(self) -> None:
        t = splits()
        t.arrived("i", 2.0, steps_in_flight=True)
        t.came_back(99, None, 2.1)  # an empty (held-back) step: not measured
        t.came_back(1, 1.5, 2.4)
        t.scheduled(["i"], 2, 2.4)
        t.came_back(2, 2.4, 2.6)
        close(self, t.first_token("i", 2.6), 0.4, 0.0, 0.2)

    def test_the_front_ends_arrival_is_believed_only_when_plausible(self) -> None:
        self.assertEqual(core_arrival(100.0, 5000.0, 4999.75), 99.75)
        self.assertEqual(core_arrival(100.0, 5000.0, 5000.5), 100.0)  # from the future
        self.assertEqual(core_arrival(100.0, 5000.0, 5000.0 - MAX_FRONT_END_S - 1), 100.0)


if __name__ == "__main__":
    unittest.main()
