"""The engine configurations the step scheduler refuses at start-up, each in one line.

The scheduler runs inside vLLM's own scheduling loop and keeps vLLM's rules only where it has
been built and tested to. What it has not been, it refuses before the engine serves anything,
rather than schedule wrongly:

- a scheduling policy other than ``priority``: batch is known by its request priority, which
  vLLM's API server accepts only under ``--scheduling-policy priority`` (under ``fcfs`` every
  request would be interactive and nothing would be paused);
- pipeline parallelism: a step's tokens are scheduled before the step before it has come
  back, so a paused or capped request's state is not what the plan reads;
- data parallelism: each engine core would run its own scheduler with the same metrics port,
  and the worker beside the engine reads one;
- a KV connector: requests loading or saving KV remotely wait in states the plan does not
  weigh, and preempting them needs the connector's own hand-over;
- speculative decoding: a decode step carries ``1 + k`` tokens, which the step-time model
  would count as prefill and the cap would cut.

Split prefill rules (chunked prefill off, Mamba/hybrid block alignment, multimodal encoder
inputs, pooling requests, the MTP prefill lookahead) are kept, not refused: the scheduler gives
such a request a whole chunk as vLLM sized it, or nothing (``backfill_vllm.scheduler``).

Nothing here imports vLLM: the scheduler reads the facts off its config.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnsupportedEngineConfigError(RuntimeError):
    """The engine runs a configuration the step scheduler does not handle."""


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the refusals read of the engine's configuration."""

    scheduling_policy: str
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    kv_connector: str | None = None
    num_spec_tokens: int = 0


def refusals(facts: EngineFacts) -> list[str]:
    """One reason per configuration the scheduler refuses (empty: it runs)."""
    out: list[str] = []
    if facts.scheduling_policy != "priority":
        out.append(
            f"--scheduling-policy {facts.scheduling_policy}: batch is known by its request "
            "priority, which vLLM accepts only under --scheduling-policy priority"
        )
    if facts.pipeline_parallel_size > 1:
        out.append(
            f"--pipeline-parallel-size {facts.pipeline_parallel_size}: pipeline parallelism "
            "is not supported"
        )
    if facts.data_parallel_size > 1:
        out.append(
            f"--data-parallel-size {facts.data_parallel_size}: data parallelism is not "
            "supported (run one engine per data-parallel rank, each with its own worker)"
        )
    if facts.kv_connector:
        out.append(f"--kv-transfer-config ({facts.kv_connector}): KV connectors are not supported")
    if facts.num_spec_tokens > 0:
        out.append(
            f"speculative decoding ({facts.num_spec_tokens} speculative tokens) is not supported"
        )
    return out


def refusal_line(reasons: list[str]) -> str:
    """The one line the engine stops with."""
    return (
        "backfill_vllm refuses this engine: "
        + "; ".join(reasons)
        + ". Fix the flags, or drop --scheduler-cls to run vLLM's own scheduler"
    )
