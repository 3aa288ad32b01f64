"""The protection benchmark's bookkeeping: variants, settings overrides, the batch token
count, and the goals, without an engine."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill_analysis.simulate.trace import TraceOptions, TraceRequest, load_trace
from bench.protection.compare import TRACE, TRACE_ROWS, TRACE_SKIP
from bench.protection.plan import TARGET_BUSY, busy_share, overload_reason, size_stretch, verdict
from bench.protection.record import ScenarioResult, parse_variant
from bench.protection.replay import InteractiveResult, Target, interactive_body, sse_data
from bench.protection.report import HEADERS, closing_verdict, plot, rows, tradeoff_points, verdicts
from bench.protection.run import scheduler_policy
from bench.stack import counters, settings_env
from devkit.enginespeed import EngineSpeed


def _engine(generated: float) -> dict[str, float]:
    return {
        "vllm:num_preemptions_total": 0.0,
        "vllm:generation_tokens_total": generated,
        "vllm:prompt_tokens_total": 0.0,
        "vllm:prefix_cache_hits_total": 0.0,
    }


def _request(i: int, ttft: float, tokens: int, status: int = 200) -> InteractiveResult:
    r = InteractiveResult(i, 100, tokens, scheduled=float(i), sent=float(i), status=status)
    if status == 200:
        r.first = r.sent + ttft
        r.chunk_times = [r.first + 0.1 * k for k in range(tokens)]
        r.output_tokens = tokens
    return r


def test_variant_names_its_overrides() -> None:
    v = parse_variant("tight:max_in_flight_per_node=4, BACKFILL_HEADROOM_TOKENS=2048")
    assert v.name == "tight"
    assert settings_env(v.overrides) == {
        "BACKFILL_MAX_IN_FLIGHT_PER_NODE": "4",
        "BACKFILL_HEADROOM_TOKENS": "2048",
    }
    assert parse_variant("plain").overrides == {}


def test_variant_without_value_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_variant("bad:max_in_flight_per_node")


def test_batch_tokens_are_the_engine_count_less_interactive_tokens() -> None:
    result = ScenarioResult(
        name="a",
        policy="priority",
        interactive=[_request(0, 0.5, 10), _request(1, 0.7, 6), _request(2, 0, 0, status=429)],
        batch="backfill",
        window_s=10.0,
        engine=_engine(1016.0),
    )
    assert result.batch_output_tokens == 1000
    assert result.batch_tps == 100.0
    assert result.rejected == 1
    assert result.ttfts == [0.5, 0.7]
    summary = result.summary()
    assert summary["interactive_rejected"] == 1
    assert summary["batch_tokens_processed"] == 1016 - 16 - 200  # less interactive's 2 x 100
    assert summary["batch_tokens_processed_per_s"] == pytest.approx(80.0)
    (row,) = rows([summary])
    assert len(row) == len(HEADERS)
    assert summary["requests"][2]["ttft_s"] is None


def test_goals_compare_backfill_with_alone_and_peers() -> None:
    def s(name: str, p99: float | None, tps: float | None) -> dict[str, object]:
        return {"scenario": name, "ttft_p99_s": p99, "batch_output_tokens_per_s": tps}

    goals = verdicts(
        [
            s("alone", 2.0, None),
            s("batch-backfill", None, 100.0),
            s("batch-straight", None, 120.0),
            s("a", 2.4, 70.0),
            s("b", 3.0, 90.0),
            s("c", 4.0, 96.0),
            s("a:tight", 2.1, 40.0),
        ]
    )
    assert goals["ttft_p99_ratio"] == pytest.approx(1.2)
    assert goals["a_ttft_p99_below_b"] is True
    assert goals["batch_kept_a"] == pytest.approx(0.7)
    assert goals["batch_kept_c"] == pytest.approx(0.8)
    assert goals["a:tight_ttft_p99_ratio"] == pytest.approx(1.05)
    assert goals["a:tight_batch_kept"] == pytest.approx(0.4)


def test_tradeoff_points_judge_each_path_against_its_own_batch_alone(tmp_path: Path) -> None:
    def s(
        name: str,
        batch: str | None,
        p50: float | None,
        p99: float | None,
        tps: float | None,
        **overrides: str,
    ) -> dict[str, Any]:
        return {
            "scenario": name,
            "batch": batch,
            "ttft_p50_s": p50,
            "ttft_p99_s": p99,
            "batch_output_tokens_per_s": tps,
            "overrides": overrides,
            "requests": [],
        }

    summaries = [
        s("alone", None, 1.0, 2.0, None),
        s("batch-backfill", "backfill", None, None, 100.0),
        s("batch-straight", "straight", None, None, 120.0),
        s("a", "backfill", 1.5, 2.4, 70.0, interactive_ttft_target_s="4"),
        s("a:off", "backfill", 2.0, 3.2, 90.0, work_budget_enabled="false"),
        s("b", "straight", 1.2, 3.0, 90.0),
        s("c", "straight", None, None, 96.0),  # no interactive figures: left out
    ]
    points = {p["scenario"]: p for p in tradeoff_points(summaries)}
    assert set(points) == {"a", "a:off", "b"}
    assert points["a"]["label"] == "a (interactive_ttft_target_s=4)"
    assert points["a"]["batch_kept"] == pytest.approx(0.7)
    assert points["a:off"]["ttft_p99_ratio"] == pytest.approx(1.6)
    assert points["b"]["batch_kept"] == pytest.approx(0.75)  # against straight, not Backfill
    assert points["b"]["ttft_p50_ratio"] == pytest.approx(1.2)
    assert tradeoff_points(summaries[1:]) == []  # no interactive-alone baseline
    for row in summaries:
        row.update(interactive_requests=0, engine_preemptions=0.0)
    out = tmp_path / "p.png"
    plot(summaries, out, "test")
    assert out.read_bytes().startswith(b"\x89PNG")


def test_goals_missing_a_scenario_are_none() -> None:
    goals = verdicts([{"scenario": "alone", "ttft_p99_s": 1.0, "batch_output_tokens_per_s": None}])
    assert goals["ttft_p99_ratio"] is None
    assert goals["a_ttft_p99_below_b"] is None


def test_interactive_body_has_exact_sizes_and_priority_only_when_straight() -> None:
    req = TraceRequest(0.0, 37, 5)
    straight = interactive_body(req, Target("http://e", "m", priority=0), random.Random(1))
    gateway = interactive_body(req, Target("http://g", "m", priority=None), random.Random(1))
    assert len(straight["prompt"]) == 37
    assert straight["max_tokens"] == straight["min_tokens"] == 5
    assert straight["ignore_eos"] is True
    assert straight["priority"] == 0
    assert "priority" not in gateway


def test_counters_sum_over_labels() -> None:
    text = (
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0"} 2.0\n'
        'vllm:num_preemptions_total{engine="1"} 3.0\n'
    )
    got = counters(text, ["vllm:num_preemptions_total", "vllm:prompt_tokens_total"])
    assert got == {"vllm:num_preemptions_total": 5.0, "vllm:prompt_tokens_total": 0.0}


def test_stream_events_are_split_on_newlines_only() -> None:
    body = 'data: {"text": "a\u2028b\x85c"}\n\ndata: [DONE]\n\n'.encode()

    async def read() -> list[str]:
        response = httpx.Response(200, content=body)
        return [d async for d in sse_data(response)]

    assert asyncio.run(read()) == ['{"text": "a\u2028b\x85c"}', "[DONE]"]


# ---------------------------------------------------------------------------------------------
# Sizing the load from the engine's speed, and the verdict


def _trace(n: int, gap_s: float, prompt: int = 100, output: int = 10) -> list[TraceRequest]:
    return [TraceRequest(i * gap_s, prompt, output) for i in range(n)]


def test_the_stretch_keeps_the_engine_about_the_target_busy_on_a_fast_and_a_slow_engine() -> None:
    trace = _trace(1000, 0.1)  # 10 requests a trace second
    fast = EngineSpeed(prefill_tokens_per_s=10_000, decode_tokens_per_s=100)  # 0.11 s each
    slow = EngineSpeed(prefill_tokens_per_s=100, decode_tokens_per_s=10)  # 2 s each
    at_fast = size_stretch(trace, fast.seconds_for, 60.0)
    at_slow = size_stretch(trace, slow.seconds_for, 60.0)
    for sized, cost in ((at_fast, 0.11), (at_slow, 2.0)):
        assert sized.sized
        assert TARGET_BUSY - cost / 60 <= sized.planned_busy <= TARGET_BUSY
        assert sized.planned_busy == pytest.approx(len(sized.requests) * cost / 60)
        assert all(r.arrival_s < 60.0 for r in sized.requests)
    # The slow engine gets a longer stretch: fewer requests in the same window.
    assert at_slow.time_scale > 10 * at_fast.time_scale
    assert len(at_slow.requests) == 9  # 9 x 2 s = 18 s = 30% of 60 s


def test_a_given_stretch_is_kept_and_its_load_reported() -> None:
    trace = _trace(100, 1.0)
    given = size_stretch(trace, lambda p, o: 1.0, 30.0, time_scale=2.0)
    assert not given.sized
    assert given.time_scale == 2.0
    assert len(given.requests) == 15  # arrivals 0, 2, ..., 28
    assert given.planned_busy == pytest.approx(0.5)


def test_a_light_trace_is_replayed_whole_inside_the_window() -> None:
    trace = _trace(5, 10.0)  # spans 40 s
    sized = size_stretch(trace, lambda p, o: 0.1, 60.0)
    assert len(sized.requests) == 5
    assert sized.requests[-1].arrival_s < 60.0
    assert sized.planned_busy == pytest.approx(0.5 / 60)


def test_any_trace_of_the_same_columns_is_sized(tmp_path: Path) -> None:
    csv = tmp_path / "other.csv"
    rows = [f"{i * 0.5:.3f},{200 + i},{5 + i % 3}" for i in range(400)]
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    trace = load_trace(csv, TraceOptions(max_prompt_tokens=1500, max_output_tokens=64))
    sized = size_stretch(trace, EngineSpeed(1000, 50).seconds_for, 30.0)
    assert 0.2 < sized.planned_busy <= TARGET_BUSY
    slice_of_it = TraceOptions(
        max_prompt_tokens=1500, max_output_tokens=64, skip=TRACE_SKIP, rows=TRACE_ROWS
    )
    bundled = load_trace(TRACE, slice_of_it)
    assert len(bundled) == 2000
    # The slice starts at its own first arrival (row 201 of the hour: 18:20:23.15).
    assert bundled[0].arrival_s == 0.0
    assert (bundled[0].prompt_tokens, bundled[0].output_tokens) == (217, 9)
    assert size_stretch(bundled, EngineSpeed(1000, 50).seconds_for, 30.0).requests


def test_busy_share_counts_overlapping_requests_once_and_only_inside_the_window() -> None:
    assert busy_share([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(0.4)
    assert busy_share([(8, 15)], 0, 10) == pytest.approx(0.2)
    assert busy_share([], 0, 10) == 0.0


def test_interactive_busy_is_measured_from_the_replayed_requests() -> None:
    result = ScenarioResult(
        name="alone",
        policy="priority",
        interactive=[_request(0, 0.5, 6), _request(1, 0.5, 6), _request(5, 0.2, 1)],
        batch=None,
        window_s=10.0,
        engine=_engine(13.0),
    )
    # Spans: 0-1.0, 1-2.0, 5-5.2 (sent to last chunk)
    assert result.interactive_busy == pytest.approx(0.22)
    assert result.summary()["interactive_busy"] == pytest.approx(0.22)


def test_overloaded_interactive_alone_gives_no_verdict() -> None:
    assert overload_reason(0.35, 0.4, 0.3) is None
    busy = overload_reason(0.9, 0.4, 0.3)
    assert busy is not None
    assert busy.startswith("interactive alone overloaded")
    queued = overload_reason(0.4, 94.0, 1.4)  # the AVX2 machine at x70
    assert queued is not None
    assert "TTFT p50 94.00 s" in queued
    judged = verdict(1.0, 1.0, 0.9, busy)
    assert not judged.ok
    assert judged.reason == busy


def test_the_verdict_needs_p50_p99_and_batch_kept_together() -> None:
    assert verdict(1.05, 1.08, 0.62, None).ok
    assert verdict(1.05, 1.08, 0.62, None).worst == pytest.approx(1.08 / 1.1)
    p99_alone_is_not_enough = verdict(1.77, 1.05, 0.7, None)  # p50 far off
    assert not p99_alone_is_not_enough.ok
    assert p99_alone_is_not_enough.worst == pytest.approx(1.77 / 1.1)
    kept_too_little = verdict(1.0, 1.0, 0.16, None)  # the AVX2 run that said ok on p99
    assert not kept_too_little.ok
    assert kept_too_little.worst == pytest.approx(0.6 / 0.16)
    missing = verdict(None, 1.0, 0.7, None)
    assert not missing.ok
    assert missing.reason == "not measured: ttft_p50_ratio"


def test_the_closing_verdict_judges_a_against_alone_and_batch_backfill() -> None:
    def s(name: str, **kw: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"scenario": name, "ttft_p50_s": None, "ttft_p99_s": None,
                               "itl_p99_s": None, "batch_output_tokens_per_s": None,
                               "interactive_busy": None, "batch_tokens_processed": None,
                               "backfill": {}}  # fmt: skip
        row.update(kw)
        return row

    summaries = [
        s("alone", ttft_p50_s=0.5, ttft_p99_s=1.0, itl_p99_s=0.05, interactive_busy=0.3),
        s("batch-backfill", batch_output_tokens_per_s=100.0),
        s("batch-straight", batch_output_tokens_per_s=125.0),
        s("a", ttft_p50_s=0.52, ttft_p99_s=1.05, itl_p99_s=0.1, batch_output_tokens_per_s=65.0,
          batch_tokens_processed=40_000.0, backfill={"recomputed_tokens_on_resume": 1000}),
    ]  # fmt: skip
    goals = verdicts(summaries)
    assert goals["ttft_p50_ratio"] == pytest.approx(1.04)
    assert goals["itl_p99_ratio"] == pytest.approx(2.0)
    assert goals["recomputed_share_a"] == pytest.approx(0.025)
    assert goals["batch_backfill_vs_straight"] == pytest.approx(0.8)
    assert closing_verdict(summaries, goals, 0.2).ok
    summaries[0]["interactive_busy"] = 0.8
    overloaded = closing_verdict(summaries, goals, 0.2)
    assert not overloaded.ok
    assert overloaded.reason is not None


def test_the_scheduler_class_names_the_engine_in_the_table() -> None:
    assert scheduler_policy("backfill_vllm.scheduler.StepScheduler") == "priority+StepScheduler"
