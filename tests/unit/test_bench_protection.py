"""The protection benchmark's bookkeeping: variants, settings overrides, the batch token
count, and the goals, without an engine."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from backfill_analysis.simulate.trace import TraceRequest
from bench.protection import ScenarioResult, parse_variant, plot, tradeoff_points, verdicts
from bench.replay import InteractiveResult, Target, interactive_body, sse_data
from bench.stack import counters, settings_env


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
    def s(name: str, batch: str | None, p50: float | None, p99: float | None,
          tps: float | None, **overrides: str) -> dict[str, Any]:
        return {"scenario": name, "batch": batch, "ttft_p50_s": p50, "ttft_p99_s": p99,
                "batch_output_tokens_per_s": tps, "overrides": overrides, "requests": []}

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
