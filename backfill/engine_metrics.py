"""Measured capacity: the KV pool an engine allocated and what it is doing now, read from its
``/metrics`` text.

vLLM publishes the pool as ``vllm:cache_config_info{num_gpu_blocks, block_size, ...}``:
:func:`parse_cache_config` reads it (admission reserves against this figure, not a computed
one); :func:`parse_engine_load` reads the live load (usage, running and waiting requests,
preemptions, token counters). The planned side, from the model's architecture, is
``backfill.capacity``'s.

Imports no FastAPI, Celery or vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from backfill.capacity import CapacityError

__all__ = [
    "EngineLoad",
    "EnginePool",
    "MetricMalformed",
    "MetricMissing",
    "MetricsError",
    "parse_cache_config",
    "parse_cache_configs",
    "parse_engine_load",
]


class MetricsError(CapacityError):
    """The engine's ``/metrics`` text does not say what Backfill needs."""


class MetricMissing(MetricsError):
    """A required metric (or label) is absent: the engine is not vLLM, too old, or misnamed."""


class MetricMalformed(MetricsError):
    """The text is not valid Prometheus exposition, or a value is not what the metric means."""


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
    model's architecture, :func:`backfill.capacity.plan_pool` should arrive at ``num_blocks``."""
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
