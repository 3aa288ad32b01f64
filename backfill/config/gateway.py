"""The interactive gateway: the priority and cache salt of interactive requests, how long one
waits for room, what one may run and reserve, and the share of a node one tenant may hold."""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backfill.config.fields import PositiveFloat, PositiveInt


class GatewaySettings(BaseModel):
    """Interactive requests: their waits, bounds and each tenant's share."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    interactive_priority: int = 0
    """the engine priority interactive requests are sent at (batch goes at
    `BACKFILL_BATCH_PRIORITY`)"""
    tenant_cache_salt: bool = True
    """every interactive request and every batch item's request (not embeddings) carries its
    tenant's `cache_salt`, whatever the caller or the line sent: a tenant's requests share their
    prompt prefixes in the engine's cache, two tenants' never do, so no tenant can time
    another's prompts (`backfill.cache_salt`)"""
    gateway_max_wait_s: Annotated[float, Field(ge=0)] = 10.0
    """how long an interactive request waits for room unless it sends `X-Backfill-Max-Wait`"""
    gateway_max_wait_cap_s: Annotated[float, Field(ge=0)] = 60.0
    """the longest wait for room a request may ask for; a longer `X-Backfill-Max-Wait` is
    clamped (`X-Backfill-Max-Wait-Applied` says so)"""
    gateway_max_sequences: PositiveInt = 16
    """sequences (`n` x prompts) one interactive request may run; more is a 400"""
    gateway_max_request_tokens: PositiveInt = 65_536
    """KV tokens one interactive request may reserve over all its sequences (`n` x (prompt +
    `max_tokens`)); more is a 400"""
    gateway_node_refresh_s: PositiveFloat = 5.0
    """how often the gateway rereads the registered nodes"""
    gateway_bound_admission: bool = True
    """admit interactive requests on an upper bound of their prompt's tokens (UTF-8 bytes +
    what the tokenizer or template adds, measured once per shape) when they fit without
    preempting, settled to the engine's count when it reports one (`false`: always count on
    the engine first)"""
    gateway_tenant_share: Annotated[float, Field(gt=0, le=1)] = 0.5
    """the fraction of a node's measured pool that one tenant's interactive requests may hold at
    once: past it the tenant waits for its own requests to end (429 `tenant_interactive_share`,
    with `Retry-After`, once its `X-Backfill-Max-Wait` is over), while other tenants are
    admitted on the node; what it may not hold goes to batch, which another tenant's request
    preempts. A tenant holding nothing on a node is never refused by it. `1`: no bound (a
    single-tenant deployment loses nothing by it)"""

    gate_node: str | None = None
    """the node an engine gate admits interactive requests on: the name its worker registers
    (`vllm serve ... --middleware queue_api.engine_gate.EngineGate`, docs/engine-gate.md: the
    gateway inside the engine's own API server, no proxy hop); the gate refuses to start
    without it"""

    @model_validator(mode="after")
    def _gateway_wait(self) -> Self:
        if self.gateway_max_wait_s > self.gateway_max_wait_cap_s:
            raise ValueError(
                "BACKFILL_GATEWAY_MAX_WAIT_S must not exceed BACKFILL_GATEWAY_MAX_WAIT_CAP_S "
                f"(got {self.gateway_max_wait_s} and {self.gateway_max_wait_cap_s})"
            )
        return self
