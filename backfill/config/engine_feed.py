"""How a worker feeds batch to its node's engine: the share of the KV pool batch never takes,
the priority and streaming of batch requests, what is in flight and how often it may be
preempted or retried, stalls, the prefix pass's holds, and how the worker reaches the engine
and its step scheduler."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from backfill.config.fields import PositiveInt


class EngineFeedSettings(BaseModel):
    """Each node's KV pool and the worker that feeds its engine."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    interactive_reserve_fraction: Annotated[float, Field(ge=0, le=1)] = 0.25
    """share of each node's measured pool batch never takes"""
    headroom_tokens: Annotated[int, Field(ge=0)] = 0
    """extra room kept from batch above interactive use"""
    safety_margin_tokens: Annotated[int, Field(ge=0)] = 0
    """extra room never handed to batch (estimate error)"""
    interactive_max_sequence_tokens: PositiveInt = 32_768
    """prompt + max_tokens limit of an interactive request (and the model's context)"""

    batch_priority: int = 10
    """vLLM priority of batch requests (interactive: 0); must equal the engine scheduler's
    `BACKFILL_SCHED_BATCH_PRIORITY`, or the worker keeps preempting for interactive TTFT itself
    and says so"""
    batch_stream_interval: PositiveInt = 16
    """batch output streams from the engine in chunks of this many tokens (first token at
    once): less CPU per item for the worker and vLLM's API server; a preempted item keeps its
    output up to its last chunk (one SSE event a token cost more CPU than the tokens
    themselves on small models)"""
    max_in_flight_per_node: PositiveInt = 128
    """items a worker keeps in flight on its engine at most"""
    max_preemptions_per_item: Annotated[int, Field(ge=0)] = 3
    """preemptions an item may suffer; then the item runs to the end, not preemptible"""
    max_attempts_per_item: PositiveInt = 5
    """an item fails after this many engine errors, or this many times its worker process died
    while running it ("worker lost N times")"""
    shutdown_grace_s: Annotated[float, Field(ge=0)] = 30.0
    """SIGTERM: in-flight items may finish this long, then are requeued"""
    batch_stream_stall_s: Annotated[float, Field(ge=0)] = 120.0
    """a batch stream that sends nothing this long while its engine makes no progress at all is
    a hung engine: the attempt is stopped as an engine error (requeued, its lease released) and
    the worker sends one item at a time until the engine makes progress again; waiting behind
    interactive work is not a stall (`0`: never)"""
    prefix_pass_hold_s: Annotated[float, Field(ge=0, le=60)] = 10.0
    """on a node that looks for shared prompt prefixes (its engine caches them), a new batch's
    items stay in the queue until the batch's prefix pass has recorded them (a page at a time,
    the first of 16 items), this many seconds at most after it went in progress: claimed
    before, they would reserve whole prompts; a batch no
    node looks at, or whose pass failed, is claimed after it (at most `60`, against deadlines
    of hours; `0`: never wait)"""
    prefix_first_prefill_wait_s: Annotated[float, Field(ge=0)] = 30.0
    """the items of a shared prefix wait in the queue (untouched) while its first holder on the
    node prefills, this long at most; then they reserve whole prompts"""
    engine_scheduler_metrics_url: str | None = None
    """where the node's engine scheduler (`backfill_vllm`) serves its metrics: while they
    answer, the engine pauses batch in the steps interactive work needs, and the work budget
    stops preempting batch for interactive TTFT (unset: the engine runs vLLM's own scheduler)"""
    engine_api_key: SecretStr | None = None
    """the engines' key (vLLM's `--api-key`): the worker and the gateway send it, nobody else
    reaches an engine's `/v1` routes (unset: the engines take requests from anyone)"""
