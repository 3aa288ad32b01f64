"""Architectures of common open models and the GPUs they run on, for capacity planning.

Model figures are copied from each model's ``config.json`` on its Hugging Face hub page
(the ``source`` field); parameter counts from the model cards. GPU figures are the vendors'
datasheet peaks (dense, no sparsity). Planning only: admission uses the pool the engine
measures (``backfill.engine_metrics.parse_cache_config``).
"""

from __future__ import annotations

from dataclasses import dataclass

from backfill.capacity import CapacityError, ModelArchitecture


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV-relevant architecture and its size."""

    name: str
    arch: ModelArchitecture
    params: float
    """All parameters (weights held in memory)."""
    active_params: float
    """Parameters each token passes through (differs from ``params`` for mixtures of experts)."""
    num_heads: int
    weight_bytes_per_param: float
    source: str

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.weight_bytes_per_param)


def _gqa(layers: int, kv_heads: int, head_dim: int, **extra: int) -> ModelArchitecture:
    return ModelArchitecture(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, **extra)


HF = "https://huggingface.co/{}/blob/main/config.json"

MODELS: dict[str, ModelPreset] = {
    p.name: p
    for p in (
        ModelPreset(
            "llama-3.1-8b",
            _gqa(32, 8, 128),
            8.03e9,
            8.03e9,
            32,
            2,
            HF.format("meta-llama/Llama-3.1-8B"),
        ),
        ModelPreset(
            "llama-3.1-70b",
            _gqa(80, 8, 128),
            70.6e9,
            70.6e9,
            64,
            2,
            HF.format("meta-llama/Llama-3.1-70B"),
        ),
        ModelPreset(
            "qwen2.5-7b",
            _gqa(28, 4, 128),
            7.62e9,
            7.62e9,
            28,
            2,
            HF.format("Qwen/Qwen2.5-7B-Instruct") + " (use_sliding_window: false)",
        ),
        ModelPreset(
            "qwen2.5-72b",
            _gqa(80, 8, 128),
            72.7e9,
            72.7e9,
            64,
            2,
            HF.format("Qwen/Qwen2.5-72B-Instruct") + " (use_sliding_window: false)",
        ),
        ModelPreset(
            "mistral-7b",
            _gqa(32, 8, 128),
            7.25e9,
            7.25e9,
            32,
            2,
            HF.format("mistralai/Mistral-7B-Instruct-v0.3") + " (v0.3: no sliding window)",
        ),
        ModelPreset(
            "mixtral-8x7b",
            _gqa(32, 8, 128),
            46.7e9,
            12.9e9,
            32,
            2,
            HF.format("mistralai/Mixtral-8x7B-Instruct-v0.1"),
        ),
        # MLA: one latent of kv_lora_rank plus the decoupled RoPE key per layer and token;
        # weights ship in FP8 (1 byte), the KV cache in bf16.
        ModelPreset(
            "deepseek-v3",
            ModelArchitecture(
                num_layers=61, num_kv_heads=1, head_dim=1, kv_lora_rank=512, qk_rope_head_dim=64
            ),
            671e9,
            37e9,
            128,
            1,
            HF.format("deepseek-ai/DeepSeek-V3"),
        ),
        # Alternating local (window 4,096) and global attention layers: 21 of 42 sliding.
        ModelPreset(
            "gemma-2-9b",
            _gqa(42, 8, 256, sliding_window=4096, num_sliding_layers=21),
            9.24e9,
            9.24e9,
            16,
            2,
            HF.format("google/gemma-2-9b"),
        ),
        ModelPreset(
            "smollm2-135m",
            _gqa(30, 3, 64),
            134.5e6,
            134.5e6,
            9,
            2,
            HF.format("HuggingFaceTB/SmolLM2-135M-Instruct"),
        ),
    )
}


@dataclass(frozen=True)
class GpuPreset:
    """A GPU's memory and datasheet peaks."""

    name: str
    memory_bytes: int
    peak_bf16_flops: float
    memory_bandwidth: float
    """Bytes per second."""
    source: str


GPUS: dict[str, GpuPreset] = {
    g.name: g
    for g in (
        GpuPreset(
            "h100",
            80 * 2**30,
            989e12,
            3.35e12,
            "NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s, "
            "989 TFLOPS BF16 dense (1,979 with sparsity)",
        ),
        GpuPreset(
            "h200",
            141 * 10**9,
            989e12,
            4.8e12,
            "NVIDIA H200 datasheet, SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS BF16 dense",
        ),
        GpuPreset(
            "a100",
            80 * 2**30,
            312e12,
            2.039e12,
            "NVIDIA A100 datasheet, 80 GB SXM: 2,039 GB/s, 312 TFLOPS BF16 dense",
        ),
    )
}


def model_preset(name: str) -> ModelPreset:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise CapacityError(f"unknown model {name!r}; presets: {', '.join(MODELS)}") from None


def gpu_preset(name: str) -> GpuPreset:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise CapacityError(f"unknown GPU {name!r}; presets: {', '.join(GPUS)}") from None
