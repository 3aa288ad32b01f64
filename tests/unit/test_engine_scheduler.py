"""The worker's reading of the engine step scheduler's metrics (``backfill_sched_*``)."""

from __future__ import annotations

from backfill.engine_scheduler import EngineScheduler, parse_scheduler_metrics
from backfill_vllm.metrics import SchedulerMetrics
from backfill_vllm.stepmodel import StepFit

SCHEDULER_TEXT = """\
# HELP backfill_sched_info The scheduler's version and settings (value 1).
# TYPE backfill_sched_info gauge
backfill_sched_info{batch_priority="10",version="0.1.0",vllm_version="0.32.0"} 1.0
# HELP backfill_sched_batch_paused_steps_total Steps with batch paused.
# TYPE backfill_sched_batch_paused_steps_total counter
backfill_sched_batch_paused_steps_total 42.0
# HELP backfill_sched_batch_tokens_held_total Tokens held back.
# TYPE backfill_sched_batch_tokens_held_total counter
backfill_sched_batch_tokens_held_total 640.0
# HELP backfill_sched_batch_pauses_total Pauses begun.
# TYPE backfill_sched_batch_pauses_total counter
backfill_sched_batch_pauses_total 16.0
# HELP backfill_sched_batch_relief_total Relief.
# TYPE backfill_sched_batch_relief_total counter
backfill_sched_batch_relief_total 1.0
# HELP backfill_sched_batch_preemptions_total Preemptions.
# TYPE backfill_sched_batch_preemptions_total counter
backfill_sched_batch_preemptions_total{reason="kv"} 2.0
backfill_sched_batch_preemptions_total{reason="seqs"} 1.0
# HELP backfill_sched_batch_paused Paused now.
# TYPE backfill_sched_batch_paused gauge
backfill_sched_batch_paused 3.0
# HELP backfill_sched_batch_longest_pause_seconds Longest pause.
# TYPE backfill_sched_batch_longest_pause_seconds gauge
backfill_sched_batch_longest_pause_seconds 1.25
"""

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 0.0
"""


SCHEDULER_SEEN = EngineScheduler(
    version="0.1.0",
    vllm_version="0.32.0",
    batch_priority=10,
    paused_steps=42,
    tokens_held=640,
    pauses=16,
    relief=1,
    preemptions=3,
    paused_now=3,
    longest_pause_s=1.25,
)
"""What the worker reads from ``SCHEDULER_TEXT`` (and from what the scheduler serves)."""


def test_the_schedulers_metrics_say_it_runs_and_what_it_did() -> None:
    seen = parse_scheduler_metrics(SCHEDULER_TEXT)
    assert seen == SCHEDULER_SEEN
    assert seen.name == "backfill_vllm 0.1.0 (vLLM 0.32.0)"
    assert EngineScheduler.from_json(seen.to_json()) == seen


def test_an_engine_without_the_scheduler_or_garbage_is_none() -> None:
    assert parse_scheduler_metrics(VLLM_TEXT) is None
    assert parse_scheduler_metrics("not {prometheus") is None
    assert parse_scheduler_metrics("") is None
    assert EngineScheduler.from_json("[1]") is None
    assert EngineScheduler.from_json('{"unknown": 1}') is None


def test_what_the_engine_scheduler_serves_is_what_the_worker_reads() -> None:
    # backfill_vllm.metrics renders the text the engine core serves; the worker parses it.
    served = SchedulerMetrics(
        "0.1.0",
        "0.32.0",
        10,
        steps=90,
        paused_steps=42,
        tokens_held=640,
        pauses=16,
        relief=1,
        preemptions_kv=2,
        preemptions_seqs=1,
        paused_now=3,
        longest_pause_s=1.25,
        chunk_cap=48,
        lifted_steps=30,
        tokens_capped=4096,
        fit=StepFit(0.01, 0.0002, 64),
    )
    text = served.render()
    assert parse_scheduler_metrics(text) == SCHEDULER_SEEN
    assert "backfill_sched_chunk_cap_tokens 48.0" in text
    assert "backfill_sched_step_model_per_token_seconds 0.0002" in text
    assert "backfill_sched_lifted_steps_total 30.0" in text
    assert "backfill_sched_batch_tokens_capped_total 4096.0" in text
