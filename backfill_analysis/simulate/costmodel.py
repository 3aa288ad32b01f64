"""How long one engine step takes, as a function of the work in it.

A continuous-batching engine runs in steps; each step runs every scheduled sequence's new
tokens through the model once. Its time grows with what it processes, which is how batch work
slows interactive work even when KV space is plentiful (the peer runs in
``bench/RESULTS.md``: engine priority alone left interactive TTFT 1.7x and inter-token
time ~7x worse). The model is linear in five features, so it can be fitted by least squares
to measurements of a real engine (:func:`fit_cost_model`) or derived from a GPU's published
peak figures (:func:`roofline`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CALIBRATION_DIR = Path(__file__).resolve().parent / "calibration"


@dataclass(frozen=True)
class StepWork:
    """The features of one step."""

    prefill_tokens: int = 0
    """Prompt tokens computed this step (chunks of one or more prompts)."""
    prefill_attention: float = 0.0
    """Sum over those prompt tokens of the context each attends to (grows ~P^2/2 for a
    prompt of P): attention is what makes long prompts dearer per token."""
    decode_tokens: int = 0
    """Sequences generating one token this step."""
    decode_context: int = 0
    """Sum of the decoding sequences' context lengths (KV read per step)."""


FEATURES = (
    "step_overhead_s",
    "per_prefill_token_s",
    "per_prefill_attention_s",
    "per_decode_token_s",
    "per_decode_context_s",
)


@dataclass(frozen=True)
class CostModel:
    """``step = a + b*prefill_tokens + d*prefill_attention + c*decode_tokens + e*context``."""

    name: str
    step_overhead_s: float
    per_prefill_token_s: float
    per_prefill_attention_s: float
    per_decode_token_s: float
    per_decode_context_s: float
    request_overhead_s: float = 0.0
    """From a request's arrival to when the engine may schedule it (HTTP, tokenizing): it
    adds to time to first token but takes no step time."""
    source: str = ""

    def __post_init__(self) -> None:
        values = [getattr(self, f) for f in FEATURES] + [self.request_overhead_s]
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise ValueError(f"cost model terms must be finite and >= 0: {self}")
        if self.step_overhead_s <= 0 and self.per_decode_token_s <= 0:
            raise ValueError("a step must take time: give step_overhead_s or per_decode_token_s")

    def step_seconds(self, work: StepWork) -> float:
        return (
            self.step_overhead_s
            + self.per_prefill_token_s * work.prefill_tokens
            + self.per_prefill_attention_s * work.prefill_attention
            + self.per_decode_token_s * work.decode_tokens
            + self.per_decode_context_s * work.decode_context
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        names = (*FEATURES, "name", "request_overhead_s", "source")
        fields = {k: data[k] for k in names if k in data}
        return cls(**fields)


def prefill_attention(start: int, tokens: int) -> float:
    """Attention pairs of a prompt chunk covering positions ``start+1 .. start+tokens``."""
    return tokens * start + tokens * (tokens + 1) / 2


@dataclass(frozen=True)
class Observation:
    """One measured duration and the work that took it.

    ``steps`` steps of identical ``work`` took ``seconds`` in all; ``with_request_overhead``
    marks a time-to-first-token measurement, which also contains the request's overhead.
    """

    work: StepWork
    seconds: float
    steps: int = 1
    with_request_overhead: bool = False


def _row(obs: Observation) -> list[float]:
    w, n = obs.work, obs.steps
    return [
        float(n),
        float(n * w.prefill_tokens),
        n * w.prefill_attention,
        float(n * w.decode_tokens),
        float(n * w.decode_context),
        1.0 if obs.with_request_overhead else 0.0,
    ]


def _solve(rows: list[list[float]], ys: list[float], cols: list[int]) -> list[float]:
    """Least squares on the chosen columns (normal equations; Gaussian elimination)."""
    k = len(cols)
    # Columns differ by orders of magnitude (1 vs 1e6 attention pairs): scale for stability.
    scale = [max(1e-30, *(abs(r[c]) for r in rows)) for c in cols]
    a = [[0.0] * (k + 1) for _ in range(k)]
    for r, y in zip(rows, ys, strict=True):
        x = [r[c] / s for c, s in zip(cols, scale, strict=True)]
        for i in range(k):
            for j in range(k):
                a[i][j] += x[i] * x[j]
            a[i][k] += x[i] * y
    for i in range(k):
        pivot = max(range(i, k), key=lambda p: abs(a[p][i]))
        a[i], a[pivot] = a[pivot], a[i]
        if abs(a[i][i]) < 1e-18:
            raise ValueError("observations do not separate the cost model's terms")
        for p in range(k):
            if p != i:
                f = a[p][i] / a[i][i]
                a[p] = [vp - f * vi for vp, vi in zip(a[p], a[i], strict=True)]
    return [a[i][k] / a[i][i] / scale[i] for i in range(k)]


def fit_cost_model(
    observations: Sequence[Observation], *, name: str, source: str
) -> tuple[CostModel, float]:
    """Non-negative least squares by elimination: fit, drop any term that came out negative
    (a negative cost is noise, not physics), refit. Returns the model and the RMS relative
    error over the observations."""
    if len(observations) < 6:
        raise ValueError("need at least six observations to fit six terms")
    rows = [_row(o) for o in observations]
    # Relative error matters (a 2 s prefill and a 20 ms decode step count alike): weight each
    # row by 1/y.
    ys = [o.seconds for o in observations]
    weighted = [[v / y for v in r] for r, y in zip(rows, ys, strict=True)]
    ones = [1.0] * len(ys)
    cols = [c for c in range(6) if any(r[c] for r in rows)]
    while True:
        coef = _solve(weighted, ones, cols)
        negative = [c for c, v in zip(cols, coef, strict=True) if v < 0]
        if not negative:
            break
        cols = [c for c in cols if c not in negative]
    full = [0.0] * 6
    for c, v in zip(cols, coef, strict=True):
        full[c] = v
    model = CostModel(
        name=name,
        step_overhead_s=full[0],
        per_prefill_token_s=full[1],
        per_prefill_attention_s=full[2],
        per_decode_token_s=full[3],
        per_decode_context_s=full[4],
        request_overhead_s=full[5],
        source=source,
    )
    errors = [
        (sum(x * f for x, f in zip(r, full, strict=True)) - y) / y
        for r, y in zip(rows, ys, strict=True)
    ]
    return model, math.sqrt(sum(e * e for e in errors) / len(errors))


def roofline(
    *,
    name: str,
    params: float,
    kv_bytes_per_token: int,
    weight_bytes: float,
    peak_flops: float,
    memory_bandwidth: float,
    num_layers: int,
    num_heads: int,
    head_dim: int,
    tensor_parallel: int = 1,
    flops_efficiency: float = 0.5,
    bandwidth_efficiency: float = 0.8,
    scheduler_overhead_s: float = 0.0005,
    source: str = "",
) -> CostModel:
    """A cost model from a GPU's peak figures and a dense model's size.

    Assumptions (stated because they set the result): every step reads all weights once
    (memory-bound floor); each token, prefill or decode, costs ``2 x params`` FLOPs; each
    attention pair costs ``4 x layers x heads x head_dim`` FLOPs; each decoding sequence reads
    its whole KV once per step; compute and memory time *add* (no overlap), which errs
    towards slower steps, i.e. less batch throughput than a real engine would give.
    """
    flops = peak_flops * flops_efficiency * tensor_parallel
    bandwidth = memory_bandwidth * bandwidth_efficiency * tensor_parallel
    return CostModel(
        name=name,
        step_overhead_s=scheduler_overhead_s + weight_bytes / bandwidth,
        per_prefill_token_s=2 * params / flops,
        per_prefill_attention_s=4 * num_layers * num_heads * head_dim / flops,
        per_decode_token_s=2 * params / flops,
        per_decode_context_s=kv_bytes_per_token / bandwidth,
        source=source,
    )


def load(name: str) -> CostModel:
    """A stored cost model: a calibration file's name (``calibration/NAME.json``)."""
    path = CALIBRATION_DIR / f"{name}.json"
    if not path.is_file():
        known = sorted(p.stem for p in CALIBRATION_DIR.glob("*.json"))
        raise ValueError(f"no cost model {name!r}; stored: {', '.join(known) or 'none'}")
    data = json.loads(path.read_text())
    return CostModel.from_json(data["model"])
