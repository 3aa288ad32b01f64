"""The per-node batch work budget (`backfill.work_budget`): the interactive TTFT it protects,
its bounds and steps, how often it steps, and the interactive signals it reads."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backfill.config.fields import PositiveFloat, PositiveInt


class WorkBudgetSettings(BaseModel):
    """Batch work beside the KV reservation: sequences in flight, prompt tokens in prefill."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    interactive_ttft_target_s: PositiveFloat = 1.0
    """interactive time to first token the batch work budget protects; set it from what
    interactive alone gets on the engine (here, on CPU, ~3 s p50: use 4-8 s)"""
    work_budget_enabled: bool = True
    """per-node batch work budget (sequences in flight, prompt tokens in prefill) beside the KV
    reservation"""
    work_budget_floor_seqs: PositiveInt = 1
    """its bounds: the fewest batch sequences in flight"""
    work_budget_ceiling_seqs: PositiveInt = 128
    """its bounds: the most batch sequences in flight (also capped by
    `BACKFILL_MAX_IN_FLIGHT_PER_NODE`)"""
    work_budget_floor_prefill_tokens: PositiveInt = 512
    """its bounds: the fewest batch prompt tokens in prefill"""
    work_budget_ceiling_prefill_tokens: PositiveInt = 16_384
    """its bounds: the most batch prompt tokens in prefill"""
    work_budget_decrease_factor: Annotated[float, Field(gt=0, lt=1)] = 0.5
    """its steps: multiplied by the factor on a sign of batch hurting interactive"""
    work_budget_increase_seqs: PositiveInt = 8
    """its steps: sequences grown by once quiet"""
    work_budget_increase_prefill_tokens: PositiveInt = 2048
    """its steps: prefill tokens grown by once quiet"""
    work_budget_quiet_s: Annotated[float, Field(ge=0)] = 2.0
    """growth resumes this long after the last sign of batch hurting interactive"""
    work_budget_preempt_at_fraction: Annotated[float, Field(gt=0, le=1)] = 0.5
    """running batch prefills are preempted once a pending interactive request has used this
    fraction of its target"""
    work_budget_interval_s: PositiveFloat = 0.25
    """how often the budget steps (an engine `/metrics` read, shared with the KV observer and
    the stall watch, and four Redis round trips)"""
    work_budget_interval_with_scheduler_s: PositiveFloat = 1.0
    """how often the budget steps while the engine runs Backfill's step scheduler, which pauses
    batch itself (the budget then only bounds what batch has in flight)"""
    work_signal_ttl_s: PositiveFloat = 3.0
    """how long the interactive signals a gateway publishes live in Redis (a gateway gone silent
    stops counting)"""

    @model_validator(mode="after")
    def _work_budget_bounds(self) -> Self:
        if self.work_budget_floor_seqs > self.work_budget_ceiling_seqs:
            raise ValueError(
                "BACKFILL_WORK_BUDGET_FLOOR_SEQS must not exceed BACKFILL_WORK_BUDGET_CEILING_SEQS"
            )
        if self.work_budget_floor_prefill_tokens > self.work_budget_ceiling_prefill_tokens:
            raise ValueError(
                "BACKFILL_WORK_BUDGET_FLOOR_PREFILL_TOKENS must not exceed "
                "BACKFILL_WORK_BUDGET_CEILING_PREFILL_TOKENS"
            )
        return self
