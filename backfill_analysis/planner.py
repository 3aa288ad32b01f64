"""Capacity planning: what a model on a GPU (or a CPU KV budget) gives each traffic class.

From the architecture: KV bytes per token, the pool in tokens and blocks, how many sequences
of each class fit at given lengths, and the interactive reserve a trace needs (the p99 of the
tokens its requests hold at once). Planning only: the pool admission uses is the one the
engine measures (:func:`check_against_engine` compares the two).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from backfill.capacity import (
    CapacityError,
    ModelArchitecture,
    gpu_kv_budget_bytes,
    kv_bytes_for_sequence,
    kv_bytes_per_token,
    plan_pool,
    round_up_to_block,
)
from backfill.engine_metrics import EnginePool
from backfill_analysis.presets import ModelPreset
from backfill_analysis.simulate.trace import TraceRequest, concurrent_tokens, time_weighted_quantile


@dataclass(frozen=True)
class Hardware:
    """Where the KV cache lives: GPUs (memory x utilisation - weights - activations) or a
    fixed budget (vLLM on CPU: ``VLLM_CPU_KVCACHE_SPACE``)."""

    gpu_memory_bytes: int = 0
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.9
    activation_peak_bytes: int = 2 * 2**30
    """Per GPU; vLLM profiles it at start (planning guess: ~1-3 GiB for 7-70B models)."""
    kv_budget_bytes: int | None = None
    """Per GPU: given directly, it replaces the memory arithmetic."""
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.block_size < 1:
            raise CapacityError("tensor_parallel and block_size must be >= 1")
        if self.kv_budget_bytes is None and self.gpu_memory_bytes <= 0:
            raise CapacityError("give GPU memory or a KV budget")


def shard(arch: ModelArchitecture, tensor_parallel: int) -> ModelArchitecture:
    """The architecture one tensor-parallel rank holds KV for: KV heads split across ranks
    (replicated when there are fewer heads than ranks); an MLA latent is not split."""
    if arch.is_mla or tensor_parallel == 1:
        return arch
    heads = max(1, math.ceil(arch.num_kv_heads / tensor_parallel))
    return dataclasses.replace(arch, num_kv_heads=heads)


@dataclass(frozen=True)
class ClassFit:
    """How many sequences of one length fit a share of the pool."""

    service_class: str
    sequence_tokens: int
    pool_tokens: int
    sequences: int


@dataclass(frozen=True)
class CapacityPlan:
    """The planned pool and what it holds."""

    model: str
    kv_bytes_per_token: int
    """Across all layers and all ranks (the model's figure)."""
    kv_bytes_per_token_per_gpu: int
    kv_budget_bytes_per_gpu: int
    weights_bytes_per_gpu: int
    num_blocks: int
    block_size: int
    capacity_tokens: int
    interactive_reserve_tokens: int
    fits: tuple[ClassFit, ...]
    trace_p99_tokens: int | None = None
    trace_peak_tokens: int | None = None


def _sequence_tokens(arch: ModelArchitecture, tokens: int, block_size: int) -> int:
    """Pool tokens one sequence of ``tokens`` takes (sliding layers stop at their window)."""
    per_token = kv_bytes_per_token(arch)
    return round_up_to_block(math.ceil(kv_bytes_for_sequence(arch, tokens) / per_token), block_size)


def interactive_reserve_from_trace(
    requests: Sequence[TraceRequest],
    *,
    decode_tokens_per_s: float,
    prefill_tokens_per_s: float,
    quantile: float = 0.99,
    block_size: int = 16,
) -> tuple[int, int]:
    """The tokens the trace's requests hold at once: (time-weighted quantile, peak), each
    request charged its whole ``prompt + output`` rounded to blocks while it runs."""
    blocked = [
        TraceRequest(
            r.arrival_s,
            round_up_to_block(r.prompt_tokens + r.output_tokens, block_size) - r.output_tokens,
            r.output_tokens,
        )
        for r in requests
    ]
    levels = concurrent_tokens(blocked, decode_tokens_per_s, prefill_tokens_per_s)
    peak = max((level for _, level in levels), default=0)
    return time_weighted_quantile(levels, quantile), peak


def plan(
    model: ModelPreset,
    hardware: Hardware,
    *,
    lengths: Sequence[tuple[str, int]] = (("interactive", 4096), ("batch", 1024)),
    reserve_tokens: int | None = None,
    reserve_fraction: float = 0.25,
    trace: Sequence[TraceRequest] | None = None,
    decode_tokens_per_s: float = 30.0,
    prefill_tokens_per_s: float = 10_000.0,
) -> CapacityPlan:
    """Plan one engine's pool. The interactive reserve is, in order of precedence: the
    tokens given, the trace's p99 concurrent demand, or ``reserve_fraction`` of the pool."""
    tp = hardware.tensor_parallel
    per_gpu = shard(model.arch, tp)
    weights = model.weight_bytes // tp
    if hardware.kv_budget_bytes is not None:
        budget = hardware.kv_budget_bytes
    else:
        budget = gpu_kv_budget_bytes(
            hardware.gpu_memory_bytes,
            gpu_memory_utilization=hardware.gpu_memory_utilization,
            weights_bytes=weights,
            activation_peak_bytes=hardware.activation_peak_bytes,
        )
    pool = plan_pool(budget, per_gpu, hardware.block_size)
    capacity = pool.capacity_tokens
    p99 = peak = None
    if reserve_tokens is None and trace is not None:
        p99, peak = interactive_reserve_from_trace(
            trace,
            decode_tokens_per_s=decode_tokens_per_s,
            prefill_tokens_per_s=prefill_tokens_per_s,
            block_size=hardware.block_size,
        )
        reserve_tokens = p99
    if reserve_tokens is None:
        reserve_tokens = math.ceil(reserve_fraction * capacity)
    reserve = min(capacity, round_up_to_block(reserve_tokens, hardware.block_size))
    fits = []
    for cls, length in lengths:
        share = reserve if cls == "interactive" else capacity - reserve
        seq = _sequence_tokens(model.arch, length, hardware.block_size)
        fits.append(ClassFit(cls, length, share, share // seq if seq else 0))
    return CapacityPlan(
        model=model.name,
        kv_bytes_per_token=kv_bytes_per_token(model.arch),
        kv_bytes_per_token_per_gpu=pool.bytes_per_token,
        kv_budget_bytes_per_gpu=budget,
        weights_bytes_per_gpu=weights,
        num_blocks=pool.num_blocks,
        block_size=hardware.block_size,
        capacity_tokens=capacity,
        interactive_reserve_tokens=reserve,
        fits=tuple(fits),
        trace_p99_tokens=p99,
        trace_peak_tokens=peak,
    )


@dataclass(frozen=True)
class EngineCheck:
    """The planned pool next to the one a running engine reports."""

    planned_blocks: int
    measured_blocks: int
    planned_tokens: int
    measured_tokens: int
    block_size_matches: bool

    @property
    def ratio(self) -> float:
        """Measured over planned tokens (1.0: the plan is exact)."""
        return self.measured_tokens / self.planned_tokens if self.planned_tokens else math.inf


def check_against_engine(planned: CapacityPlan, measured: EnginePool) -> EngineCheck:
    return EngineCheck(
        planned_blocks=planned.num_blocks,
        measured_blocks=measured.num_blocks,
        planned_tokens=planned.capacity_tokens,
        measured_tokens=measured.capacity_tokens,
        block_size_matches=planned.block_size == measured.block_size,
    )
