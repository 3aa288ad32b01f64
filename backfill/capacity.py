"""The capacity model: KV-cache bytes per token, block rounding, and the pool an engine reports.

Two sources of truth, used for different things:

* **Measured** (admission uses only this): vLLM publishes the pool it allocated as
  ``vllm:cache_config_info{num_gpu_blocks, block_size, ...}`` on ``/metrics``;
  :func:`parse_cache_config` reads it, :func:`parse_engine_load` reads the live load.
* **Planned** (capacity planning, and checking the engine's figure): bytes of KV cache per
  token from the model's architecture, and how many tokens a memory budget holds.

Imports no FastAPI, Celery or vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from backfill.errors import BackfillError

__all__ = [
    "CapacityError",
    "EngineLoad",
    "EnginePool",
    "MetricMalformed",
    "MetricMissing",
    "MetricsError",
    "ModelArchitecture",
    "PlannedPool",
    "blocks_for",
    "dtype_bytes",
    "gpu_kv_budget_bytes",
    "kv_bytes_for_sequence",
    "kv_bytes_per_token",
    "parse_cache_config",
    "parse_cache_configs",
    "parse_engine_load",
    "plan_pool",
    "round_up_to_block",
]


class CapacityError(BackfillError):
    """A capacity figure cannot be computed from what was given."""


class MetricsError(CapacityError):
    """The engine's ``/metrics`` text does not say what Backfill needs."""


class MetricMissing(MetricsError):
    """A required metric (or label) is absent: the engine is not vLLM, too old, or misnamed."""


class MetricMalformed(MetricsError):
    """The text is not valid Prometheus exposition, or a value is not what the metric means."""


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


# ---------------------------------------------------------------------------------------------
# Measured: the engine's /metrics

_CACHE_CONFIG = "vllm:cache_config_info"


@dataclass(frozen=True)
class _Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def _only(metrics_text: str, names: frozenset[str]) -> str:
    """The exposition text with only the samples named ``names`` and their families' HELP and
    TYPE lines: vLLM's ``/metrics`` is mostly histogram buckets, and parsing all of them on
    every control step cost the worker more CPU than the rest of its loop. The other
    families' comment lines go too: kept, they were ~180 of the ~200 lines left and most of
    the parse (a real 52 kB page from vLLM 0.32: 3.7-5.4 ms a read with them, 0.9-2.0 ms
    without, interleaved on a loaded machine; the worker reads it ~5 times a second, on the
    cores the engine runs on)."""
    families = names | {n.removesuffix("_total") for n in names}
    kept = []
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) > 2 and parts[1] in ("HELP", "TYPE") and parts[2] in families:
                kept.append(line)
        elif line.split("{", 1)[0].split(" ", 1)[0] in names:
            kept.append(line)
    kept.append("")
    return "\n".join(kept)


def _samples(metrics_text: str, names: frozenset[str] | None = None) -> list[_Sample]:
    if names is not None:
        metrics_text = _only(metrics_text, names)
    try:
        return [
            _Sample(sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples
        ]
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricMalformed(f"not Prometheus text exposition: {exc}") from exc


def _matches(labels: Mapping[str, str], model_name: str | None, engine: str | None) -> bool:
    return (model_name is None or labels.get("model_name") == model_name) and (
        engine is None or labels.get("engine") == engine
    )


@dataclass(frozen=True)
class EnginePool:
    """The KV pool one engine allocated, as it reports it: capacity measured, not computed."""

    num_blocks: int
    block_size: int
    capacity_tokens: int
    """``num_blocks x block_size``: the tokens admission may reserve against."""
    reported_size_tokens: int | None = None
    """The engine's own ``kv_cache_size_tokens`` label, when it publishes one."""
    kv_cache_memory_bytes: int | None = None
    """The memory budget the engine sized the pool from, when it publishes it: with the
    model's architecture, :func:`plan_pool` should arrive at ``num_blocks``."""
    cache_dtype: str | None = None
    model_name: str | None = None
    engine: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    @property
    def prefix_caching(self) -> bool:
        """The engine keeps a shared prompt prefix's blocks once for every request that
        starts with it (its ``enable_prefix_caching`` label; off where it does not say)."""
        return self.labels.get("enable_prefix_caching", "").strip().lower() == "true"


def _int_label(labels: Mapping[str, str], name: str) -> int:
    raw = labels.get(name)
    if raw is None or raw in {"", "None"}:
        raise MetricMissing(f"{_CACHE_CONFIG} has no {name} label (labels: {sorted(labels)})")
    try:
        value = int(float(raw))
    except ValueError:
        raise MetricMalformed(f"{_CACHE_CONFIG} label {name}={raw!r} is not a number") from None
    if value <= 0 or value != float(raw):
        raise MetricMalformed(f"{_CACHE_CONFIG} label {name}={raw!r} is not a positive integer")
    return value


def _optional_int_label(labels: Mapping[str, str], name: str) -> int | None:
    if labels.get(name) in (None, "", "None"):
        return None
    return _int_label(labels, name)


def parse_cache_configs(metrics_text: str) -> list[EnginePool]:
    """Every pool in the text (one per engine and model; data-parallel servers have several)."""
    # prometheus_client names an `info`-typed family without the `_info` suffix, and a gauge
    # or untyped family with it; the samples keep the full name either way.
    pools: list[EnginePool] = []
    for sample in _samples(metrics_text):
        if sample.name not in {_CACHE_CONFIG, _CACHE_CONFIG.removesuffix("_info")}:
            continue
        labels = sample.labels
        num_blocks = _int_label(labels, "num_gpu_blocks")
        block_size = _int_label(labels, "block_size")
        pools.append(
            EnginePool(
                num_blocks=num_blocks,
                block_size=block_size,
                capacity_tokens=num_blocks * block_size,
                reported_size_tokens=_optional_int_label(labels, "kv_cache_size_tokens"),
                kv_cache_memory_bytes=_optional_int_label(labels, "kv_cache_memory_bytes"),
                cache_dtype=labels.get("cache_dtype"),
                model_name=labels.get("model_name"),
                engine=labels.get("engine"),
                labels=labels,
            )
        )
    return pools


def parse_cache_config(
    metrics_text: str, *, model_name: str | None = None, engine: str | None = None
) -> EnginePool:
    """The one KV pool in an engine's ``/metrics`` text (``vllm:cache_config_info``).

    With several engines or models in the text, ``model_name``/``engine`` pick one; an
    ambiguous or empty choice raises rather than guessing which pool admission should use.
    """
    pools = [p for p in parse_cache_configs(metrics_text) if _matches(p.labels, model_name, engine)]
    if not pools:
        wanted = f" for model_name={model_name!r} engine={engine!r}" if model_name or engine else ""
        raise MetricMissing(
            f"no {_CACHE_CONFIG}{wanted} in the metrics text: is this a vLLM server's /metrics?"
        )
    if len(pools) > 1:
        which = ", ".join(f"(model_name={p.model_name!r}, engine={p.engine!r})" for p in pools)
        raise MetricsError(f"{len(pools)} pools in the metrics text; choose one of {which}")
    return pools[0]


@dataclass(frozen=True)
class EngineLoad:
    """What the engine is doing now (gauges) and has done (counters, since it started)."""

    kv_cache_usage_perc: float
    """Fraction (0..1, despite the name) of the KV blocks physically allocated."""
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    waiting_by_reason: Mapping[str, int] = field(default_factory=dict)
    finished_by_reason: Mapping[str, int] = field(default_factory=dict)

    def allocated_tokens(self, pool: EnginePool) -> int:
        """KV tokens physically held now (block-granular), as opposed to tokens reserved."""
        return round(self.kv_cache_usage_perc * pool.num_blocks) * pool.block_size


_LOAD_METRICS: dict[str, tuple[str, ...]] = {
    # Older vLLM called the usage gauge gpu_cache_usage_perc; accept either.
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "num_preemptions_total": ("vllm:num_preemptions_total",),
    "prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "generation_tokens_total": ("vllm:generation_tokens_total",),
}


_LOAD_SAMPLES = frozenset(
    {name for names in _LOAD_METRICS.values() for name in names}
    | {"vllm:num_requests_waiting_by_reason", "vllm:request_success_total"}
)


def _sum_by(samples: Iterable[_Sample], name: str, label: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in samples:
        if s.name == name:
            key = s.labels.get(label, "")
            out[key] = out.get(key, 0) + round(s.value)
    return out


def parse_engine_load(
    metrics_text: str, *, model_name: str | None = None, engine: str | None = None
) -> EngineLoad:
    """The engine's load from its ``/metrics`` text, summed over engines unless one is chosen
    (usage is averaged: engines of one server have pools of equal size)."""
    samples = [
        s for s in _samples(metrics_text, _LOAD_SAMPLES) if _matches(s.labels, model_name, engine)
    ]
    found: dict[str, list[float]] = {}
    for attr, names in _LOAD_METRICS.items():
        for name in names:
            values = [s.value for s in samples if s.name == name]
            if values:
                found[attr] = values
                break
        else:
            raise MetricMissing(
                f"no {' or '.join(names)} in the metrics text"
                + (f" for model_name={model_name!r}" if model_name else "")
            )
    for attr, values in found.items():
        if any(math.isnan(v) or v < 0 for v in values):
            raise MetricMalformed(f"{attr} has a negative or NaN value: {values}")
    usage = sum(found["kv_cache_usage_perc"]) / len(found["kv_cache_usage_perc"])
    if usage > 1.0 + 1e-9:
        raise MetricMalformed(f"kv_cache_usage_perc is a fraction in [0, 1], got {usage}")

    def total(attr: str) -> int:
        return round(sum(found[attr]))

    return EngineLoad(
        kv_cache_usage_perc=usage,
        num_requests_running=total("num_requests_running"),
        num_requests_waiting=total("num_requests_waiting"),
        num_preemptions_total=total("num_preemptions_total"),
        prompt_tokens_total=total("prompt_tokens_total"),
        generation_tokens_total=total("generation_tokens_total"),
        waiting_by_reason=_sum_by(samples, "vllm:num_requests_waiting_by_reason", "reason"),
        finished_by_reason=_sum_by(samples, "vllm:request_success_total", "finished_reason"),
    )
