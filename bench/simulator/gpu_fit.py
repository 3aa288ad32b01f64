"""The simulator's cost model fitted to steps timed by ``bench.gpu_step_times``.

The standard library and ``backfill_analysis.simulate.costmodel`` alone (itself the standard
library alone), so that the GPU machine, which has PyTorch and nothing of ours installed, can
fit what it measured; ``bench.gpu_steps`` uses the same functions here.
"""

from __future__ import annotations

from typing import Any

from backfill_analysis.simulate.costmodel import (
    CostModel,
    Observation,
    StepWork,
    fit_cost_model,
    prefill_attention,
)

GRAPH, EAGER = "graph_s", "eager_s"


def step_work(step: dict[str, Any]) -> StepWork:
    """A measured step's work in the cost model's terms."""
    prefill, decodes = int(step["prefill"]), int(step["decodes"])
    return StepWork(
        prefill_tokens=prefill,
        prefill_attention=prefill_attention(int(step["start"]), prefill) if prefill else 0.0,
        decode_tokens=decodes,
        decode_context=decodes * int(step["context"]),
    )


def observations(steps: list[dict[str, Any]], timed: str = GRAPH) -> list[Observation]:
    """Each measured step's ``timed`` time (CUDA graph or eager); a step that failed, or was
    not timed that way, is left out."""
    return [Observation(step_work(s), float(s[timed])) for s in steps if s.get(timed) is not None]


def fit(measured: dict[str, Any], timed: str = GRAPH) -> tuple[CostModel, float]:
    """The cost model fitted to ``measured`` (a ``bench.gpu_step_times`` output) and its RMS
    relative error. ValueError when the steps do not separate the model's terms."""
    env = measured["environment"]
    how = "CUDA graphs" if timed == GRAPH else "eager"
    return fit_cost_model(
        observations(measured["steps"], timed),
        name="h200-llama-3.1-8b-torch" if timed == GRAPH else f"{env['model']}-{how}",
        source=(
            f"fitted by python -m bench.gpu_steps to steps of a Llama-3.1-8B-shaped decoder "
            f"(random bf16 weights, PyTorch {env['torch']}, {how}, stock kernels) timed "
            f"on one {env['device']} by python -m bench.gpu_step_times"
        ),
    )
