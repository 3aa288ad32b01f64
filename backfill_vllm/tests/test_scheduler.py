"""BackfillScheduler driven with synthetic requests and no model (vLLM's own scheduler code
runs; a stand-in samples the tokens). Run with the engine venv's python:
``python -m unittest discover -s backfill_vllm/tests -t .`` (or pytest, where installed)."""

from __future__ import annotations

import socket
import time
import unittest
import urllib.request

from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import RequestStatus

from backfill_vllm.compat import UnsupportedVllmError, check_vllm_version
from backfill_vllm.refusals import UnsupportedEngineConfigError
from backfill_vllm.scheduler import BackfillAsyncScheduler, BackfillScheduler
from backfill_vllm.settings import SchedulerSettings
from backfill_vllm.stepmodel import StepFit, StepTimeModel
from backfill_vllm.tests.helpers import (
    BATCH,
    INTERACTIVE,
    TOKEN,
    blocks_of,
    engine_core,
    make_request,
    make_scheduler,
    run_step,
)

NO_BOUND = SchedulerSettings(starvation_steps=0, starvation_s=0)


def decode_batch(scheduler, n: int, *, prompt: int = 40, max_tokens: int = 50) -> list:
    """``n`` batch requests, run until each is decoding."""
    requests = [
        make_request(f"b{i}", prompt=prompt, priority=BATCH, max_tokens=max_tokens)
        for i in range(n)
    ]
    for r in requests:
        scheduler.add_request(r)
    for _ in range(50):
        if all(r.num_output_tokens >= 2 for r in requests):
            return requests
        run_step(scheduler)
    raise AssertionError("batch never started decoding")


class ClassDetection(unittest.TestCase):
    def test_batch_is_the_workers_priority_or_above(self) -> None:
        s = make_scheduler()
        self.assertTrue(s.is_batch(make_request("b", prompt=4, priority=10)))
        self.assertTrue(s.is_batch(make_request("b2", prompt=4, priority=12)))
        self.assertFalse(s.is_batch(make_request("i", prompt=4, priority=0)))
        s5 = make_scheduler(settings=SchedulerSettings(batch_priority=5))
        self.assertTrue(s5.is_batch(make_request("b5", prompt=4, priority=5)))

    def test_async_scheduling_gets_the_async_variant(self) -> None:
        self.assertIsInstance(make_scheduler(async_scheduling=True), BackfillAsyncScheduler)
        self.assertNotIsInstance(make_scheduler(), BackfillAsyncScheduler)

    def test_an_untested_vllm_is_refused_in_one_line(self) -> None:
        check_vllm_version("0.32.0+cpu", {})
        with self.assertRaises(UnsupportedVllmError) as err:
            check_vllm_version("0.31.2", {})
        said = str(err.exception)
        self.assertIn("supports vLLM 0.32.0, 0.33.0 only; this engine runs vLLM 0.31.2", said)
        self.assertNotIn("\n", said)
        check_vllm_version("0.31.2", {"BACKFILL_ALLOW_UNTESTED_VLLM": "1"})


class PauseAndResume(unittest.TestCase):
    def check_pause_keeps_state(self, async_scheduling: bool) -> None:
        s = make_scheduler(budget=64, settings=NO_BOUND, async_scheduling=async_scheduling)
        batch = decode_batch(s, 3)
        before = {r.request_id: (r.num_computed_tokens, blocks_of(s, r.request_id)) for r in batch}
        # An interactive prompt of 300 tokens prefills over 5 steps of 64.
        inter = make_request("i", prompt=300, priority=INTERACTIVE, max_tokens=4)
        s.add_request(inter)
        holding_steps = 0
        while inter.num_computed_tokens < inter.num_prompt_tokens:
            out = run_step(s)
            holding_steps += 1
            self.assertEqual(set(out.num_scheduled_tokens), {"i"})
            for r in batch:
                self.assertIn(r, s.running)
                self.assertEqual(r.status, RequestStatus.RUNNING)
                self.assertEqual(
                    (r.num_computed_tokens, blocks_of(s, r.request_id)), before[r.request_id]
                )
        self.assertEqual(holding_steps, 5)
        out = run_step(s)  # interactive decodes now; batch resumes where it was
        self.assertEqual(set(out.num_scheduled_tokens), {"i", "b0", "b1", "b2"})
        while s.has_unfinished_requests():
            run_step(s)
        for r in batch:
            self.assertEqual(r.num_preemptions, 0)
            self.assertEqual(r.num_output_tokens, 50)
        m = s.backfill_metrics
        self.assertEqual(m.paused_steps, 5)
        self.assertEqual(m.pauses, 3)
        self.assertEqual(m.tokens_held, 5 * 3)
        self.assertEqual(m.longest_pause_steps, 5)
        self.assertEqual(m.preemptions_kv + m.preemptions_seqs, 0)
        self.assertEqual(m.paused_now, 0)

    def test_paused_batch_keeps_its_blocks_and_computed_tokens(self) -> None:
        self.check_pause_keeps_state(async_scheduling=False)

    def test_paused_batch_keeps_its_blocks_and_computed_tokens_under_async(self) -> None:
        self.check_pause_keeps_state(async_scheduling=True)

    def test_waiting_batch_is_not_admitted_while_interactive_prefills(self) -> None:
        s = make_scheduler(budget=64, settings=NO_BOUND)
        s.add_request(make_request("i", prompt=200, priority=INTERACTIVE))
        s.add_request(make_request("b", prompt=10, priority=BATCH))
        for _ in range(4):  # 64 + 64 + 64 + 8 prompt tokens
            self.assertEqual(set(run_step(s).num_scheduled_tokens), {"i"})
        self.assertIn("b", set(run_step(s).num_scheduled_tokens))  # prefill done: admitted

    def test_with_no_batch_the_steps_are_vllms_own(self) -> None:
        ours, stock = make_scheduler(budget=64), make_scheduler(budget=64, stock=True)
        for s in (ours, stock):
            for i, prompt in enumerate((100, 30, 7, 250)):
                s.add_request(
                    make_request(
                        f"i{i}", prompt=prompt, priority=INTERACTIVE, max_tokens=5, arrival=float(i)
                    )
                )
        for _ in range(40):
            self.assertEqual(
                run_step(ours).num_scheduled_tokens, run_step(stock).num_scheduled_tokens
            )


class FinishWhilePaused(unittest.TestCase):
    def test_abort_while_paused_frees_everything_and_the_engine_runs_on(self) -> None:
        s = make_scheduler(budget=64, settings=NO_BOUND)
        batch = decode_batch(s, 2)
        s.add_request(make_request("i", prompt=300, priority=INTERACTIVE, max_tokens=4))
        run_step(s)
        self.assertEqual(s.backfill_metrics.paused_now, 2)
        free = s.kv_cache_manager.block_pool.get_num_free_blocks()
        held = len(blocks_of(s, "b0"))
        s.finish_requests("b0", RequestStatus.FINISHED_ABORTED)
        self.assertNotIn(batch[0], s.running)
        self.assertNotIn("b0", s.requests)
        self.assertEqual(s.kv_cache_manager.block_pool.get_num_free_blocks(), free + held)
        # Stopped from outside (a stop string the API server found) while paused.
        s.finish_requests("b1", RequestStatus.FINISHED_STOPPED)
        while s.has_unfinished_requests():
            out = run_step(s)
            self.assertNotIn("b0", out.num_scheduled_tokens)
            self.assertNotIn("b1", out.num_scheduled_tokens)
        self.assertEqual(s.running, [])
        self.assertEqual(s.requests, {})

    def test_a_batch_request_whose_last_token_lands_while_paused_finishes(self) -> None:
        # Async scheduling: step N gives batch its last decode; before N's output is back,
        # step N+1 pauses it for an interactive prefill; then N's token finishes it.
        s = make_scheduler(budget=64, settings=NO_BOUND, async_scheduling=True)
        batch = make_request("b", prompt=20, priority=BATCH, max_tokens=3)
        s.add_request(batch)
        while batch.num_output_tokens < 2:
            run_step(s)
        last = s.schedule()
        self.assertIn("b", last.num_scheduled_tokens)
        s.add_request(make_request("i", prompt=300, priority=INTERACTIVE, max_tokens=2))
        held = s.schedule()
        self.assertEqual(set(held.num_scheduled_tokens), {"i"})
        self.assertEqual(s.backfill_metrics.paused_now, 1)
        s.update_from_output(
            last,
            ModelRunnerOutput(req_ids=["b"], req_id_to_index={"b": 0}, sampled_token_ids=[[TOKEN]]),
        )
        self.assertTrue(batch.is_finished())
        self.assertNotIn(batch, s.running)
        self.assertNotIn("b", s._tracks)
        s.update_from_output(
            held, ModelRunnerOutput(req_ids=["i"], req_id_to_index={"i": 0}, sampled_token_ids=[[]])
        )
        while s.has_unfinished_requests():
            self.assertNotIn("b", run_step(s).num_scheduled_tokens)
        self.assertEqual(batch.num_output_tokens, 3)

    def test_abort_of_a_waiting_batch_request_while_holding(self) -> None:
        s = make_scheduler(budget=64, settings=NO_BOUND)
        s.add_request(make_request("i", prompt=300, priority=INTERACTIVE, max_tokens=2))
        s.add_request(make_request("b", prompt=20, priority=BATCH))
        run_step(s)
        s.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        while s.has_unfinished_requests():
            self.assertNotIn("b", run_step(s).num_scheduled_tokens)


class ChunkCap(unittest.TestCase):
    def test_batch_prefill_shares_one_capped_chunk_per_step(self) -> None:
        s = make_scheduler(budget=512, settings=SchedulerSettings(chunk_tokens=48))
        for i in range(3):
            s.add_request(make_request(f"b{i}", prompt=100, priority=BATCH))
        firsts = [run_step(s).num_scheduled_tokens for _ in range(3)]
        self.assertEqual(firsts[0], {"b0": 48})
        # What the cap kept out is counted: at least b0's other 52 prompt tokens each step.
        self.assertGreaterEqual(s.backfill_metrics.tokens_capped, 3 * 52)
        self.assertEqual(s.backfill_metrics.lifted_steps, 0)
        self.assertEqual(firsts[1], {"b0": 48})
        self.assertEqual(firsts[2], {"b0": 4, "b1": 44})
        # Decodes are not counted against the cap.
        for _ in range(10):
            out = run_step(s).num_scheduled_tokens
            prefill = sum(n for r, n in out.items() if n > 1)
            self.assertLessEqual(prefill, 48)

    def test_a_seeded_batch_prefill_is_never_split_by_the_cap_on_cpu(self) -> None:
        # vLLM 0.32's CPU runner dies on a seeded request's partial prefill ("CPU Generator
        # does not use offset", found running backfill dev): such a prefill runs whole, as
        # the step's first batch prefill, or waits for the next step.
        s = make_scheduler(budget=512, settings=SchedulerSettings(chunk_tokens=48))
        for i in range(2):
            s.add_request(make_request(f"s{i}", prompt=100, priority=BATCH, seed=7))
        self.assertEqual(run_step(s).num_scheduled_tokens, {"s0": 100})
        self.assertEqual(run_step(s).num_scheduled_tokens, {"s0": 1, "s1": 100})

    def test_the_cap_follows_the_fitted_step_time(self) -> None:
        settings = SchedulerSettings(chunk_target_s=0.01, model_min_samples=4, min_chunk_tokens=8)
        s = make_scheduler(budget=512, settings=settings)
        for tokens in (10, 100, 200, 400, 50, 300):
            s._step_model.observe(tokens, 0.002 + 0.0005 * tokens)  # 20 tokens per 10 ms
        s.add_request(make_request("b", prompt=200, priority=BATCH))
        self.assertEqual(s.schedule().num_scheduled_tokens, {"b": 20})
        self.assertEqual(s.backfill_metrics.chunk_cap, 20)

    def test_each_step_is_observed_with_its_decodes_apart_from_its_prompt_tokens(self) -> None:
        s = make_scheduler(budget=512)
        for i in range(2):
            s.add_request(make_request(f"b{i}", prompt=100, priority=BATCH))
        run_step(s)  # two prefills: 200 prompt tokens
        s.add_request(make_request("b2", prompt=60, priority=BATCH))
        run_step(s)  # two decodes and a third prefill
        seen = [(p, d) for p, d, _ in s._step_model._samples]
        self.assertEqual(seen, [(200.0, 0.0), (60.0, 2.0)])

    def test_the_cap_is_lifted_after_a_quiet_spell_and_back_when_interactive_arrives(
        self,
    ) -> None:
        s = make_scheduler(budget=512, settings=SchedulerSettings(chunk_tokens=48))
        s._interactive_seen_s -= s.backfill.lift_cap_after_s  # quiet for the whole spell
        for i in range(2):
            s.add_request(make_request(f"b{i}", prompt=200, priority=BATCH))
        self.assertEqual(run_step(s).num_scheduled_tokens, {"b0": 200, "b1": 200})
        self.assertEqual(s.backfill_metrics.chunk_cap, 512)
        self.assertEqual(s.backfill_metrics.lifted_steps, 1)
        self.assertEqual(s.backfill_metrics.tokens_capped, 0)
        s.add_request(make_request("b2", prompt=200, priority=BATCH))
        s.add_request(make_request("i", prompt=100, priority=INTERACTIVE))
        self.assertEqual(run_step(s).num_scheduled_tokens, {"i": 100})  # batch paused
        for _ in range(3):  # the interactive request decodes: capped again, not lifted
            out = run_step(s).num_scheduled_tokens
            self.assertLessEqual(out.get("b2", 0), 48)
        self.assertEqual(s.backfill_metrics.chunk_cap, 48)

    def test_interactive_prefill_is_not_capped(self) -> None:
        s = make_scheduler(budget=512, settings=SchedulerSettings(chunk_tokens=16))
        s.add_request(make_request("i", prompt=300, priority=INTERACTIVE))
        self.assertEqual(run_step(s).num_scheduled_tokens, {"i": 300})


class StarvationBound(unittest.TestCase):
    def test_a_paused_sequence_progresses_within_the_bound_in_steps(self) -> None:
        s = make_scheduler(
            budget=32, settings=SchedulerSettings(starvation_steps=4, starvation_s=0)
        )
        decode_batch(s, 2)
        s.add_request(make_request("i", prompt=640, priority=INTERACTIVE, max_tokens=2))
        gaps: list[int] = []
        since = 0
        for _ in range(20):  # 640 / 32 steps of interactive prefill
            out = run_step(s).num_scheduled_tokens
            since += 1
            if "b0" in out:
                gaps.append(since)
                since = 0
        self.assertTrue(gaps)
        self.assertLessEqual(max(gaps), 4)
        self.assertGreater(s.backfill_metrics.relief, 0)
        self.assertLessEqual(s.backfill_metrics.longest_pause_steps, 3)

    def test_a_paused_sequence_progresses_within_the_bound_in_seconds(self) -> None:
        s = make_scheduler(
            budget=32, settings=SchedulerSettings(starvation_steps=0, starvation_s=1e-9)
        )
        decode_batch(s, 1)
        s.add_request(make_request("i", prompt=320, priority=INTERACTIVE, max_tokens=2))
        outs = [run_step(s).num_scheduled_tokens for _ in range(5)]
        self.assertTrue(all("b0" in o for o in outs))

    def test_waiting_batch_is_admitted_within_the_bound_under_sustained_interactive_load(
        self,
    ) -> None:
        # A new interactive request arrives every step, so one always waits to prefill
        # (holding), with room left in each step: a batch request waiting beside them is
        # admitted once it has waited the bound in seconds (before: never while any
        # interactive work was pending).
        bound = 0.05
        s = make_scheduler(
            budget=64, settings=SchedulerSettings(starvation_steps=0, starvation_s=bound)
        )
        s.add_request(make_request("i0", prompt=20, priority=INTERACTIVE, max_tokens=2))
        run_step(s)
        s.add_request(make_request("b", prompt=40, priority=BATCH, max_tokens=4))
        started = time.monotonic()
        admitted_after = None
        for k in range(1, 200):
            s.add_request(make_request(f"i{k}", prompt=20, priority=INTERACTIVE, max_tokens=2))
            out = run_step(s)
            self.assertIn(f"i{k}", out.num_scheduled_tokens)  # interactive never waits
            if "b" in out.num_scheduled_tokens:
                admitted_after = time.monotonic() - started
                break
            time.sleep(0.002)
        self.assertIsNotNone(admitted_after, "waiting batch never admitted while holding")
        self.assertGreaterEqual(admitted_after, bound / 2)
        self.assertGreater(s.backfill_metrics.relief, 0)


class _FixedFit(StepTimeModel):
    """A step-time model that has already fitted ``fit`` (synthetic steps take microseconds)."""

    def __init__(self, fit: StepFit) -> None:
        super().__init__()
        self._fixed = fit

    def observe(self, tokens: int, seconds: float, decodes: int = 0) -> None:
        pass

    def fit(self) -> StepFit:
        return self._fixed


class WholeStepBound(unittest.TestCase):
    """While interactive work is in the engine, batch decodes and prefill together add at most
    the chunk target to a step (a decode at 1 ms, a target of 10 ms: 10 batch decodes a step,
    5 under async scheduling)."""

    def check(self, async_scheduling: bool, per_step: int) -> None:
        s = make_scheduler(
            max_num_seqs=32, budget=256, settings=NO_BOUND, async_scheduling=async_scheduling
        )
        s._step_model = _FixedFit(StepFit(0.005, 0.0001, 64, 0.001))
        batch = decode_batch(s, 24, prompt=8, max_tokens=40)
        i = make_request("i", prompt=8, priority=INTERACTIVE, max_tokens=30)
        s.add_request(i)
        step = lambda: run_step(s)  # noqa: E731
        if async_scheduling:
            # vLLM's own loop: each step scheduled while the one before it runs.
            core = engine_core(s)
            handed = core.model_executor.handed

            def step():
                before = len(handed)
                while len(handed) == before:
                    core.step_with_batch_queue()
                return handed[-1]

        while i.num_output_tokens < 1:
            step()
        moved: dict[str, int] = {r.request_id: 0 for r in batch}
        for _ in range(12):
            out = step().num_scheduled_tokens
            self.assertIn("i", out)  # the interactive stream decodes every step
            ran = [r for r in out if r != "i"]
            self.assertLessEqual(len(ran), per_step)
            for r in ran:
                moved[r] += 1
        # In turns: every batch decoder moved within the 12 steps.
        self.assertTrue(all(n > 0 for n in moved.values()), moved)
        self.assertGreater(s.backfill_metrics.bounded_steps, 0)
        while s.has_unfinished_requests() or (async_scheduling and core.batch_queue):
            if async_scheduling:
                core.step_with_batch_queue()
            else:
                run_step(s)
        self.assertTrue(all(r.num_output_tokens == 40 for r in batch))
        self.assertTrue(all(r.num_preemptions == 0 for r in batch))

    def test_batch_decodes_take_turns_beside_an_interactive_stream(self) -> None:
        self.check(async_scheduling=False, per_step=10)

    def test_under_async_scheduling_the_bound_counts_the_step_already_scheduled(self) -> None:
        self.check(async_scheduling=True, per_step=5)


class HeldBackUnderAsync(unittest.TestCase):
    """vLLM's engine loop under async scheduling (its own ``step_with_batch_queue``, a stand-in
    for the model) schedules each step while the one before it runs, so an interactive request
    arriving mid-step waits for that step and the one already queued behind it. While
    interactive work is likely and none is in the engine, the class hands the loop an empty
    step in place of a batch-only one scheduled ahead: the loop waits for the step in flight,
    and the arrival is in the next step the device runs."""

    def setUp(self) -> None:
        self.updated: list = []

    def drive(self, settings: SchedulerSettings | None = None, stock: bool = False):
        s = make_scheduler(
            async_scheduling=True, max_num_seqs=32, budget=256, settings=settings, stock=stock
        )
        core = engine_core(s)
        update = s.update_from_output

        def came_back(output, runner_output):
            if output.total_num_scheduled_tokens:
                self.updated.append(output)
            return update(output, runner_output)

        s.update_from_output = came_back
        batch = [make_request(f"b{k}", prompt=8, priority=BATCH, max_tokens=60) for k in range(6)]
        for r in batch:
            s.add_request(r)
        warm = make_request("i0", prompt=8, priority=INTERACTIVE, max_tokens=2)
        s.add_request(warm)
        for _ in range(60):
            core.step_with_batch_queue()
            if warm.is_finished() and all(r.num_output_tokens >= 4 for r in batch):
                return s, core, batch
        raise AssertionError("batch never got going")

    def steps_run_before(self, s, core, request) -> int:
        """Add ``request`` as a step comes back (it arrived while that step ran) and count the
        steps with tokens the device runs after it arrived and before the first carrying it."""
        for _ in range(4):
            came = len(self.updated)
            core.step_with_batch_queue()
            if len(self.updated) > came:
                break
        s.add_request(request)
        handed = core.model_executor.handed
        in_flight = [o for o in handed if all(o is not u for u in self.updated)]
        start = len(handed) - len(in_flight)
        for _ in range(20):
            core.step_with_batch_queue()
            for n, output in enumerate(handed):
                if request.request_id in output.num_scheduled_tokens:
                    return n - start
        raise AssertionError("the interactive request was never scheduled")

    def test_an_arrival_waits_for_no_step_queued_behind_the_one_in_flight(self) -> None:
        s, core, batch = self.drive()
        i = make_request("i", prompt=8, priority=INTERACTIVE, max_tokens=4)
        self.assertEqual(self.steps_run_before(s, core, i), 0)
        self.assertGreater(s.backfill_metrics.held_back_steps, 0)
        while s.has_unfinished_requests() or core.batch_queue:
            core.step_with_batch_queue()
        self.assertEqual(i.num_output_tokens, 4)
        self.assertTrue(all(r.num_output_tokens == 60 for r in batch))
        self.assertTrue(all(r.num_preemptions == 0 for r in batch))

    def test_stock_vllm_and_the_setting_on_run_one_batch_step_first(self) -> None:
        for stock, settings in ((True, None), (False, SchedulerSettings(ahead_while_likely=True))):
            self.updated = []
            s, core, _ = self.drive(settings, stock=stock)
            i = make_request("i", prompt=8, priority=INTERACTIVE, max_tokens=4)
            self.assertEqual(self.steps_run_before(s, core, i), 1, f"stock={stock}")

    def test_past_the_likely_window_batch_steps_are_scheduled_ahead_again(self) -> None:
        s, core, _ = self.drive(SchedulerSettings(interactive_likely_s=0.05))
        time.sleep(0.1)
        held = s.backfill_metrics.held_back_steps
        handed = len(core.model_executor.handed)
        for _ in range(6):
            core.step_with_batch_queue()
        self.assertEqual(s.backfill_metrics.held_back_steps, held)
        self.assertEqual(len(core.model_executor.handed), handed + 6)  # a step every call

    def test_an_interactive_stream_is_scheduled_ahead_beside_batch(self) -> None:
        s, core, _ = self.drive()
        i = make_request("i", prompt=8, priority=INTERACTIVE, max_tokens=12)
        s.add_request(i)
        for _ in range(3):
            core.step_with_batch_queue()
        held = s.backfill_metrics.held_back_steps
        handed = len(core.model_executor.handed)
        for _ in range(6):
            core.step_with_batch_queue()
        self.assertEqual(s.backfill_metrics.held_back_steps, held)
        self.assertEqual(len(core.model_executor.handed), handed + 6)


class IdleReady(unittest.TestCase):
    """With ``idle_ready_s``, batch sits out while interactive work is in the engine and for
    that long after: the steps carry the interactive request alone, then nothing (the engine
    idles, ready for the next arrival of a burst), and past the window batch carries on where
    it was, its KV kept."""

    def test_batch_sits_out_beside_an_interactive_request_and_right_after_it(self) -> None:
        window = 0.3
        settings = SchedulerSettings(idle_ready_s=window, starvation_s=0)
        s = make_scheduler(max_num_seqs=32, budget=256, settings=settings)
        time.sleep(window)  # the window counts from the start too
        batch = decode_batch(s, 4, prompt=8, max_tokens=40)
        i = make_request("i", prompt=8, priority=INTERACTIVE, max_tokens=6)
        s.add_request(i)
        s.add_request(make_request("w", prompt=8, priority=BATCH, max_tokens=4))
        steps = 0
        while i.num_output_tokens < 6:
            out = run_step(s)
            self.assertEqual(set(out.num_scheduled_tokens), {"i"})  # prefill and decodes
            steps += 1
        self.assertEqual(steps, 6)
        out = run_step(s)
        self.assertEqual(out.total_num_scheduled_tokens, 0)  # idle, ready
        self.assertTrue(all(r.status == RequestStatus.RUNNING for r in batch))
        time.sleep(window)
        out = run_step(s)
        self.assertEqual(set(out.num_scheduled_tokens), {"b0", "b1", "b2", "b3", "w"})
        while s.has_unfinished_requests():
            run_step(s)
        self.assertTrue(all(r.num_output_tokens == 40 for r in batch))
        self.assertTrue(all(r.num_preemptions == 0 for r in batch))

    def test_without_the_setting_batch_decodes_beside_the_interactive_stream(self) -> None:
        s = make_scheduler(max_num_seqs=32, budget=256, settings=NO_BOUND)
        decode_batch(s, 4, prompt=8, max_tokens=40)
        i = make_request("i", prompt=8, priority=INTERACTIVE, max_tokens=6)
        s.add_request(i)
        run_step(s)  # its prefill: batch holds
        out = run_step(s)
        self.assertIn("b0", out.num_scheduled_tokens)


class PreemptForInteractive(unittest.TestCase):
    def test_a_full_sequence_limit_preempts_batch_for_waiting_interactive(self) -> None:
        s = make_scheduler(max_num_seqs=2, budget=256, settings=NO_BOUND)
        batch = decode_batch(s, 2, prompt=20, max_tokens=30)
        s.add_request(make_request("i", prompt=30, priority=INTERACTIVE, max_tokens=3))
        out = run_step(s)
        self.assertIn("i", out.num_scheduled_tokens)
        self.assertEqual(len(out.preempted_req_ids), 1)
        self.assertEqual(s.backfill_metrics.preemptions_seqs, 1)
        self.assertLessEqual(len(s.running), 2)
        while s.has_unfinished_requests():
            run_step(s)
        self.assertEqual([r.num_output_tokens for r in batch], [30, 30])

    def test_kv_held_by_batch_is_given_up_for_a_waiting_interactive_request(self) -> None:
        # 20 blocks; two batch requests hold 16 of them (8 each); interactive needs 8.
        s = make_scheduler(num_blocks=21, budget=256, settings=NO_BOUND)
        batch = decode_batch(s, 2, prompt=120, max_tokens=8)
        s.add_request(make_request("i", prompt=120, priority=INTERACTIVE, max_tokens=2))
        stock = make_scheduler(num_blocks=21, budget=256, stock=True)
        decode_batch(stock, 2, prompt=120, max_tokens=8)
        stock.add_request(make_request("i", prompt=120, priority=INTERACTIVE, max_tokens=2))
        self.assertNotIn("i", run_step(stock).num_scheduled_tokens)  # vLLM waits for batch
        out = run_step(s)
        self.assertIn("i", out.num_scheduled_tokens)
        self.assertEqual(s.backfill_metrics.preemptions_kv, 1)
        while s.has_unfinished_requests():
            run_step(s)
        self.assertEqual([r.num_output_tokens for r in batch], [8, 8])

    def test_blocks_shared_with_another_request_are_not_counted_as_freed(self) -> None:
        # 20 blocks of 16. Two batch requests share a 96-token prefix (6 blocks, held once)
        # and hold ~3 blocks of their own each: 12 held, 8 free. An interactive prompt of 200
        # tokens needs 13. Preempting one batch request frees its own 3 blocks, not the
        # shared 6: both must go, or the interactive request still does not fit (and the one
        # preempted was thrown away for nothing).
        s = make_scheduler(num_blocks=21, budget=256, settings=NO_BOUND)
        batch = [
            make_request(f"b{k}", prompt=128, priority=BATCH, max_tokens=8, shared_prefix=96)
            for k in range(2)
        ]
        for r in batch:
            s.add_request(r)
        while any(r.num_output_tokens < 2 for r in batch):
            run_step(s)
        self.assertEqual(s.kv_cache_manager.block_pool.get_num_free_blocks(), 8)
        s.add_request(make_request("i", prompt=200, priority=INTERACTIVE, max_tokens=2))
        out = run_step(s)
        self.assertIn("i", out.num_scheduled_tokens)
        self.assertEqual(s.backfill_metrics.preemptions_kv, 2)
        while s.has_unfinished_requests():
            run_step(s)
        self.assertEqual([r.num_output_tokens for r in batch], [8, 8])

    def test_prompt_blocks_a_running_request_holds_are_not_asked_of_the_free_pool(self) -> None:
        # 20 blocks of 16. A batch request holds a 96-token prefix (6 blocks) and 3 of its
        # own: 11 free. An interactive prompt of 200 tokens starting with that prefix takes 13
        # blocks, 6 of them the cached prefix batch holds: 7 free blocks are enough, and no
        # batch request is preempted (vLLM itself admits it so; before, the whole prompt was
        # asked of the free pool and the batch request thrown away for nothing).
        s = make_scheduler(num_blocks=21, budget=256, settings=NO_BOUND)
        b = make_request("b", prompt=128, priority=BATCH, max_tokens=8, shared_prefix=96)
        s.add_request(b)
        while b.num_output_tokens < 2:
            run_step(s)
        self.assertEqual(s.kv_cache_manager.block_pool.get_num_free_blocks(), 11)
        s.add_request(
            make_request("i", prompt=200, priority=INTERACTIVE, max_tokens=2, shared_prefix=96)
        )
        out = run_step(s)
        self.assertIn("i", out.num_scheduled_tokens)
        self.assertEqual(s.backfill_metrics.preemptions_kv + s.backfill_metrics.preemptions_seqs, 0)
        self.assertEqual(b.num_preemptions, 0)

    def test_no_batch_is_preempted_for_interactive_work_the_token_budget_cannot_reach(self) -> None:
        # Two slots, both batch; two interactive requests of 100 tokens and a budget of 64:
        # only the first can start this step, so only one batch request gives up its slot.
        s = make_scheduler(max_num_seqs=2, budget=64, settings=NO_BOUND)
        decode_batch(s, 2, prompt=20, max_tokens=40)
        for k in range(2):
            s.add_request(make_request(f"i{k}", prompt=100, priority=INTERACTIVE, max_tokens=2))
        out = run_step(s)
        self.assertEqual(set(out.num_scheduled_tokens), {"i0"})
        self.assertEqual(s.backfill_metrics.preemptions_seqs, 1)


def hold_kv_and_wait(scheduler, request) -> None:
    """Move running ``request`` to vLLM's ``kv_holding_waiting`` with its KV blocks and computed
    tokens kept: where a request whose KV a connector has loaded, or one resumed with its
    blocks, waits (vLLM scans that queue before ``waiting``)."""
    scheduler.running.remove(request)
    request.status = RequestStatus.PREEMPTED
    scheduler.kv_holding_waiting.add_request(request)


class WaitingScan(unittest.TestCase):
    """vLLM 0.32's waiting scan stops at a request granted 0 tokens: batch that may not start
    is set aside, never granted 0 where interactive work waits behind it."""

    def check_batch_at_the_head_of_kv_holding_waiting(self, stock: bool) -> None:
        s = make_scheduler(budget=64, settings=NO_BOUND, stock=stock)
        b = make_request("b", prompt=100, priority=BATCH, max_tokens=4)
        s.add_request(b)
        run_step(s)  # 64 of its 100 prompt tokens
        self.assertEqual(b.num_computed_tokens, 64)
        hold_kv_and_wait(s, b)
        s.add_request(make_request("i", prompt=20, priority=INTERACTIVE, max_tokens=4))
        first = run_step(s)
        self.assertIn("i", first.num_scheduled_tokens)
        if not stock:
            self.assertNotIn("b", first.num_scheduled_tokens)  # holding: set aside
            self.assertIn(b, s.kv_holding_waiting)  # and put back, with its blocks
            self.assertEqual(b.num_computed_tokens, 64)
        for _ in range(30):
            if not s.has_unfinished_requests():
                break
            run_step(s)
        self.assertFalse(s.has_unfinished_requests())
        self.assertEqual(b.num_output_tokens, 4)

    def test_interactive_is_admitted_past_batch_at_the_head_of_kv_holding_waiting(self) -> None:
        self.check_batch_at_the_head_of_kv_holding_waiting(stock=False)

    def test_stock_vllm_admits_both_in_that_case(self) -> None:
        self.check_batch_at_the_head_of_kv_holding_waiting(stock=True)

    def test_no_empty_steps_while_interactive_waits_behind_waiting_batch(self) -> None:
        # Two batch requests wait (one holding KV), one interactive behind them: every step
        # has work until all are done, and interactive is served first.
        s = make_scheduler(budget=64, settings=NO_BOUND)
        b0 = make_request("b0", prompt=100, priority=BATCH, max_tokens=4)
        s.add_request(b0)
        run_step(s)
        hold_kv_and_wait(s, b0)
        s.add_request(make_request("b1", prompt=30, priority=BATCH, max_tokens=4))
        s.add_request(make_request("i", prompt=150, priority=INTERACTIVE, max_tokens=4))
        empty = 0
        order = []
        for _ in range(40):
            if not s.has_unfinished_requests():
                break
            out = run_step(s)
            empty += out.total_num_scheduled_tokens == 0
            order += [r for r in out.finished_req_ids if r not in order]
        self.assertEqual(empty, 0)
        self.assertFalse(s.has_unfinished_requests())
        self.assertEqual(order[0], "i")

    def test_interactive_that_cannot_start_does_not_hold_batch(self) -> None:
        # An interactive request waiting for more streaming input cannot start: batch goes
        # on decoding beside it (before: paused every step, with the starvation bound off).
        s = make_scheduler(budget=64, settings=NO_BOUND)
        batch = decode_batch(s, 2)
        waiting = make_request("i", prompt=20, priority=INTERACTIVE, max_tokens=4)
        s.add_request(waiting)
        waiting.status = RequestStatus.WAITING_FOR_STREAMING_REQ
        for _ in range(5):
            out = run_step(s)
            self.assertEqual(set(out.num_scheduled_tokens), {r.request_id for r in batch})
        self.assertEqual(s.backfill_metrics.paused_steps, 0)


class EngineRefusals(unittest.TestCase):
    def test_fcfs_is_refused_in_one_line(self) -> None:
        with self.assertRaises(UnsupportedEngineConfigError) as err:
            make_scheduler(policy="fcfs")
        said = str(err.exception)
        self.assertIn("--scheduling-policy fcfs", said)
        self.assertNotIn("\n", said)
        make_scheduler(policy="fcfs", stock=True)  # vLLM's own runs it


class PrefillRules(unittest.TestCase):
    def test_with_chunked_prefill_off_a_batch_prefill_runs_whole_as_on_stock(self) -> None:
        settings = SchedulerSettings(chunk_tokens=256, lift_cap_after_s=0)
        ours = make_scheduler(
            budget=2048, chunked_prefill=False, settings=settings, max_model_len=2048
        )
        stock = make_scheduler(budget=2048, chunked_prefill=False, stock=True)
        for s in (ours, stock):
            s.add_request(make_request("b", prompt=1000, priority=BATCH, max_tokens=4))
            s.add_request(make_request("c", prompt=300, priority=BATCH, max_tokens=4))
        self.assertEqual(run_step(stock).num_scheduled_tokens, {"b": 1000, "c": 300})
        # Never cut: the first batch prefill whole, the next in a later step, not 256 + ...
        first = run_step(ours).num_scheduled_tokens
        self.assertEqual(first, {"b": 1000})
        second = run_step(ours).num_scheduled_tokens
        self.assertEqual(second.get("c"), 300)
        self.assertGreater(ours.backfill_metrics.tokens_capped, 0)


class Metrics(unittest.TestCase):
    def test_the_counters_are_served_as_prometheus_text(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        s = make_scheduler(budget=64, settings=SchedulerSettings(metrics_port=port))
        self.assertIsInstance(s, BackfillScheduler)
        decode_batch(s, 1)
        s.add_request(make_request("i", prompt=200, priority=INTERACTIVE))
        run_step(s)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        self.assertIn('backfill_sched_info{batch_priority="10",version="0.1.0"', text)
        self.assertIn("backfill_sched_batch_paused_steps_total 1.0", text)
        self.assertIn("backfill_sched_batch_paused 1.0", text)
        # The one batch request is resident and decoding (the engine's own view, which a
        # client's streams can lag behind on a loaded machine).
        self.assertIn("backfill_sched_batch_running 1.0", text)
        self.assertIn("backfill_sched_batch_decoding 1.0", text)
        # A second scheduler in this process takes the port over.
        s2 = make_scheduler(settings=SchedulerSettings(metrics_port=port))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            self.assertIn("backfill_sched_batch_paused_steps_total 0.0", r.read().decode())
        del s2


if __name__ == "__main__":
    unittest.main()
