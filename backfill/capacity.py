"""The capacity model: KV-cache bytes per token, block rounding, and the pool a budget plans.

Two sources of truth, used for different things:

* **Measured** (admission uses only this): the pool the engine allocated and its live load,
  as it reports them on ``/metrics`` (``backfill.engine_metrics``).
* **Planned** (here: capacity planning, and checking the engine's figure): bytes of KV cache
  per token from the model's architecture, and how many tokens a memory budget holds.

Imports no FastAPI, Celery or vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backfill.errors import BackfillError

__all__ = [
    "CapacityError",
    "ModelArchitecture",
    "PlannedPool",
    "blocks_for",
    "dtype_bytes",
    "gpu_kv_budget_bytes",
    "kv_bytes_for_sequence",
    "kv_bytes_per_token",
    "plan_pool",
    "round_up_to_block",
]


class CapacityError(BackfillError):
    """A capacity figure cannot be computed from what was given."""


# ---------------------------------------------------------------------------------------------
# Blocks


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks needed to hold ``tokens`` (a partly used block is a whole block)."""
    if block_size <= 0:
        raise CapacityError(f"block_size must be positive, got {block_size}")
    if tokens < 0:
        raise CapacityError(f"tokens must not be negative, got {tokens}")
    return -(-tokens // block_size)


def round_up_to_block(tokens: int, block_size: int) -> int:
    """``tokens`` rounded up to whole blocks: what a reservation of ``tokens`` really takes."""
    return blocks_for(tokens, block_size) * block_size


# ---------------------------------------------------------------------------------------------
# Planning from the architecture

_DTYPE_BYTES: dict[str, int] = {
    "float32": 4, "fp32": 4, "float": 4,
    "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "int8": 1,
}  # fmt: skip


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a KV-cache dtype name as vLLM or Hugging Face spell it."""
    key = dtype.lower().removeprefix("torch.")
    try:
        return _DTYPE_BYTES[key]
    except KeyError:
        raise CapacityError(f"unknown dtype {dtype!r}; known: {', '.join(_DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelArchitecture:
    """The parts of a model's architecture that decide its KV-cache footprint.

    The common case (every layer full attention) costs ``2 x layers x kv_heads x head_dim x
    bytes_per_element`` per token: a key and a value vector per KV head per layer. Where it
    differs:

    * **MLA** (DeepSeek-V2/V3, Kimi-K2): each layer caches one compressed latent of
      ``kv_lora_rank`` plus the decoupled rotary key of ``qk_rope_head_dim`` per token,
      shared by all heads; no factor 2, no heads. Set ``kv_lora_rank``.
    * **Sliding-window layers** (Mistral-7B-v0.1, Gemma 2/3 alternating layers): such a layer
      needs at most ``sliding_window`` tokens of a sequence. vLLM frees blocks that fall out of
      the window, so per-sequence cost is capped, not per-token cost; see
      :func:`kv_bytes_for_sequence`.
    * **State layers** (Mamba, linear attention, as in Jamba or Qwen3-Next): hold a fixed
      state per sequence, whatever its length (``state_bytes_per_sequence``), and no per-token
      KV.

    vLLM's hybrid allocator pads page sizes so different layer kinds share one block pool, so
    for hybrid models the engine's figure may differ from this estimate by a few per cent.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    bytes_per_element: int = 2
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    sliding_window: int | None = None
    num_sliding_layers: int = 0
    """How many of ``num_layers`` use the sliding window (all of them when a model sets a
    window without per-layer types)."""
    num_state_layers: int = 0
    """How many of ``num_layers`` are state (Mamba / linear-attention) layers, with no KV."""
    state_bytes_per_sequence: int = 0

    def __post_init__(self) -> None:
        if self.num_layers <= 0 or self.bytes_per_element <= 0:
            raise CapacityError(f"layers and bytes per element must be positive: {self}")
        if self.kv_lora_rank is None and (self.num_kv_heads <= 0 or self.head_dim <= 0):
            raise CapacityError(f"kv heads and head dim must be positive: {self}")
        if self.num_sliding_layers + self.num_state_layers > self.num_layers:
            raise CapacityError(f"more sliding and state layers than layers: {self}")
        if self.num_sliding_layers and not self.sliding_window:
            raise CapacityError(f"sliding layers need a sliding_window: {self}")

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank is not None

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers - self.num_state_layers

    @property
    def bytes_per_token_per_layer(self) -> int:
        """KV bytes one attention layer stores for one token."""
        if self.kv_lora_rank is not None:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.bytes_per_element
        return 2 * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], *, kv_cache_dtype: str | None = None
    ) -> ModelArchitecture:
        """Read a Hugging Face ``config.json`` (as a dict).

        ``kv_cache_dtype`` overrides the model's ``torch_dtype``/``dtype`` (vLLM's
        ``--kv-cache-dtype fp8`` halves the cache of a bf16 model).
        """
        # Multimodal configs nest the language model's config.
        text: Mapping[str, Any] = config.get("text_config") or config
        try:
            layers = int(text["num_hidden_layers"])
            heads = int(text["num_attention_heads"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CapacityError(f"config lacks layer or head counts: {exc}") from None
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = text.get("head_dim") or int(text["hidden_size"]) // heads
        dtype = (
            kv_cache_dtype
            or text.get("torch_dtype")
            or text.get("dtype")
            or config.get("torch_dtype", "bfloat16")
        )
        element = dtype_bytes(str(dtype))
        kv_lora_rank = text.get("kv_lora_rank")
        window = text.get("sliding_window")
        if text.get("use_sliding_window") is False:
            # Qwen2-style configs carry a window but switch it off.
            window = None
        layer_types = text.get("layer_types")
        sliding = state = 0
        if isinstance(layer_types, list) and layer_types:
            sliding = sum(1 for t in layer_types if t == "sliding_attention")
            state = sum(1 for t in layer_types if t not in {"full_attention", "sliding_attention"})
        elif window:
            sliding = layers
        return cls(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            bytes_per_element=element,
            kv_lora_rank=int(kv_lora_rank) if kv_lora_rank else None,
            qk_rope_head_dim=int(text.get("qk_rope_head_dim") or 0) if kv_lora_rank else 0,
            sliding_window=int(window) if window and sliding else None,
            num_sliding_layers=sliding,
            num_state_layers=state,
        )


def kv_bytes_per_token(arch: ModelArchitecture) -> int:
    """KV bytes one token costs across all attention layers, while the sequence is shorter
    than any sliding window (and excluding fixed per-sequence state).

    >>> kv_bytes_per_token(ModelArchitecture(num_layers=32, num_kv_heads=8, head_dim=128))
    131072
    """
    attention_layers = arch.num_full_layers + arch.num_sliding_layers
    return attention_layers * arch.bytes_per_token_per_layer


def kv_bytes_for_sequence(arch: ModelArchitecture, tokens: int) -> int:
    """KV bytes one sequence of ``tokens`` tokens holds: full layers grow with every token,
    sliding layers stop at the window, state layers are fixed."""
    if tokens < 0:
        raise CapacityError(f"tokens must not be negative, got {tokens}")
    per_layer = arch.bytes_per_token_per_layer
    windowed = min(tokens, arch.sliding_window or tokens)
    return (
        arch.num_full_layers * per_layer * tokens
        + arch.num_sliding_layers * per_layer * windowed
        + (arch.state_bytes_per_sequence if arch.num_state_layers else 0)
    )


def gpu_kv_budget_bytes(
    total_bytes: int,
    *,
    gpu_memory_utilization: float = 0.9,
    weights_bytes: int = 0,
    activation_peak_bytes: int = 0,
) -> int:
    """What vLLM leaves for the KV cache on a GPU: its share of memory minus weights and the
    peak activation memory it profiles at start (planning only: the engine measures)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise CapacityError(f"gpu_memory_utilization must be in (0, 1]: {gpu_memory_utilization}")
    budget = int(total_bytes * gpu_memory_utilization) - weights_bytes - activation_peak_bytes
    if budget <= 0:
        raise CapacityError(
            f"no memory left for KV cache: {total_bytes} x {gpu_memory_utilization} "
            f"- weights {weights_bytes} - activations {activation_peak_bytes}"
        )
    return budget


@dataclass(frozen=True)
class PlannedPool:
    """A pool computed from a memory budget (planning): never used for admission."""

    num_blocks: int
    block_size: int
    bytes_per_token: int

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def plan_pool(kv_budget_bytes: int, arch: ModelArchitecture, block_size: int) -> PlannedPool:
    """Whole blocks of ``block_size`` tokens that fit ``kv_budget_bytes``, as vLLM sizes its
    pool (it divides the budget by the bytes of one block across all layers, rounding down).
    On CPU the budget is ``VLLM_CPU_KVCACHE_SPACE`` GiB."""
    per_token = kv_bytes_per_token(arch)
    if per_token <= 0:
        raise CapacityError(f"{arch} stores no per-token KV; its pool is not token-shaped")
    if block_size <= 0:
        raise CapacityError(f"block_size must be positive, got {block_size}")
    return PlannedPool(
        num_blocks=max(kv_budget_bytes, 0) // (per_token * block_size),
        block_size=block_size,
        bytes_per_token=per_token,
    )
