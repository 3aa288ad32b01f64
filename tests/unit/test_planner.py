"""Capacity planning: known models' figures, tensor parallelism, the trace's reserve, the
check against an engine's measured pool, and the plan/simulate commands."""

from __future__ import annotations

import http.server
import json
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from backfill.capacity import CapacityError, kv_bytes_per_token
from backfill.engine_metrics import parse_cache_config
from backfill_analysis.planner import (
    Hardware,
    check_against_engine,
    interactive_reserve_from_trace,
    plan,
    shard,
)
from backfill_analysis.presets import GPUS, MODELS, model_preset
from backfill_analysis.simulate.trace import TraceRequest
from backfill_cli.app import app

METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",engine="0",'
    'model_name="smollm2",num_gpu_blocks="364"} 1.0\n'
)


@pytest.mark.parametrize(
    ("model", "bytes_per_token"),
    [
        ("llama-3.1-8b", 131_072),  # 32 layers x 2 x 8 KV heads x 128 x 2 bytes
        ("llama-3.1-70b", 327_680),
        ("qwen2.5-7b", 57_344),
        ("mistral-7b", 131_072),
        ("mixtral-8x7b", 131_072),
        ("deepseek-v3", 70_272),  # MLA: (512 + 64) x 2 bytes x 61 layers
        ("gemma-2-9b", 344_064),
        ("smollm2-135m", 23_040),
    ],
)
def test_known_models_bytes_per_token(model: str, bytes_per_token: int) -> None:
    assert kv_bytes_per_token(model_preset(model).arch) == bytes_per_token


def test_every_preset_names_its_source() -> None:
    assert all("huggingface.co" in m.source for m in MODELS.values())
    assert all(g.source for g in GPUS.values())


def test_smollm2_on_one_gib_matches_the_engines_measured_pool() -> None:
    # notes/smollm2.md: vLLM on CPU with 1 GiB of KV reports 364 blocks of 128.
    p = plan(model_preset("smollm2-135m"), Hardware(kv_budget_bytes=2**30, block_size=128))
    assert (p.num_blocks, p.capacity_tokens) == (364, 46_592)
    check = check_against_engine(p, parse_cache_config(METRICS))
    assert check.ratio == 1.0
    assert check.block_size_matches


def test_gpu_plan_subtracts_weights_and_activations() -> None:
    hw = Hardware(
        gpu_memory_bytes=80 * 2**30, gpu_memory_utilization=0.9, activation_peak_bytes=2 * 2**30
    )
    p = plan(model_preset("llama-3.1-8b"), hw)
    budget = int(80 * 2**30 * 0.9) - int(8.03e9 * 2) - 2 * 2**30
    assert p.kv_budget_bytes_per_gpu == budget
    assert p.num_blocks == budget // (131_072 * 16)


def test_tensor_parallel_splits_kv_heads_but_not_an_mla_latent() -> None:
    assert kv_bytes_per_token(shard(model_preset("llama-3.1-70b").arch, 4)) == 327_680 // 4
    assert kv_bytes_per_token(shard(model_preset("llama-3.1-70b").arch, 16)) == 327_680 // 8
    assert kv_bytes_per_token(shard(model_preset("deepseek-v3").arch, 8)) == 70_272


def test_a_model_too_large_for_the_gpu_is_refused() -> None:
    with pytest.raises(CapacityError):
        plan(model_preset("deepseek-v3"), Hardware(gpu_memory_bytes=80 * 2**30))


def test_sliding_window_layers_stop_growing_at_the_window() -> None:
    p = plan(
        model_preset("gemma-2-9b"),
        Hardware(gpu_memory_bytes=80 * 2**30),
        lengths=(("batch", 4096), ("batch", 8192)),
    )
    at_window, beyond = p.fits
    # Twice the tokens, but half the layers stop at 4,096: 1.5x the bytes, not 2x.
    assert beyond.sequences == pytest.approx(at_window.sequences / 1.5, abs=1)


def test_sequences_per_class_split_the_pool_at_the_reserve() -> None:
    p = plan(
        model_preset("llama-3.1-8b"),
        Hardware(gpu_memory_bytes=80 * 2**30),
        reserve_tokens=100_000,
        lengths=(("interactive", 4096), ("batch", 1000)),
    )
    inter, batch = p.fits
    assert p.interactive_reserve_tokens == 100_000
    assert inter.sequences == 100_000 // 4096
    assert batch.pool_tokens == p.capacity_tokens - 100_000
    assert batch.sequences == batch.pool_tokens // 1008


def test_trace_reserve_is_the_p99_of_concurrent_tokens() -> None:
    # Two requests of 1,000 tokens overlapping half the time, one alone otherwise.
    trace = [TraceRequest(0.0, 990, 10), TraceRequest(5.0, 990, 10)]
    p99, peak = interactive_reserve_from_trace(
        trace, decode_tokens_per_s=1.0, prefill_tokens_per_s=1e9, block_size=8
    )
    assert peak == 2000
    assert p99 == 2000
    p50, _ = interactive_reserve_from_trace(
        trace, decode_tokens_per_s=1.0, prefill_tokens_per_s=1e9, quantile=0.5, block_size=8
    )
    assert p50 == 1000


runner = CliRunner()


def test_plan_command_prints_json() -> None:
    result = runner.invoke(
        app,
        ["plan", "--model", "smollm2-135m", "--kv-cache-gib", "1", "--block-size", "128", "--json"],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["num_blocks"] == 364
    assert data["kv_bytes_per_token"] == 23_040


def test_plan_command_refuses_an_unknown_model() -> None:
    result = runner.invoke(app, ["plan", "--model", "gpt-9"])
    assert result.exit_code == 1


def test_simulate_command_writes_table_json_and_plots(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    rows = [f"{i * 0.5},{200 + 37 * i % 900},{1 + i % 40}" for i in range(200)]
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    out = tmp_path / "out"
    result = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            "--duration-s",
            "60",
            "--batch-items",
            "2000",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "backfill-overcommit" in result.output
    record = json.loads((out / "simulate.json").read_text())
    assert [r["policy"] for r in record["results"]] == [
        "fifo",
        "static",
        "priority",
        "backfill",
        "backfill-overcommit",
    ]
    for name in ("kv_pool_over_time.png", "ttft_cdf.png"):
        assert (out / name).stat().st_size > 10_000


def test_plan_command_checks_against_an_engines_metrics() -> None:
    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = runner.invoke(
            app,
            [
                "plan",
                "--model",
                "smollm2-135m",
                "--kv-cache-gib",
                "1",
                "--block-size",
                "128",
                "--engine-url",
                url,
            ],
        )
        assert result.exit_code == 0, result.output
        assert "364 blocks = 46,592 tokens; plan matches" in result.output
        off = runner.invoke(
            app,
            [
                "plan",
                "--model",
                "smollm2-135m",
                "--kv-cache-gib",
                "2",
                "--block-size",
                "128",
                "--engine-url",
                url,
                "--json",
            ],
        )
        assert json.loads(off.output)["engine_check"]["ratio"] == pytest.approx(0.5, abs=0.01)
    finally:
        server.shutdown()
