"""What every API process does per request before any work: the API key cache, each tenant's and
each anonymous client's rate limit, and the `/metrics` cache."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from backfill.config.fields import PositiveFloat, PositiveInt


class ApiSettings(BaseModel):
    """Keys, rate limits, and the metrics cache of the API."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    api_key_cache_s: Annotated[float, Field(ge=0)] = 5.0
    """keys (good or wrong) remembered this long; revocation evicts at once through Redis, so
    this only bounds an API process cut off from Redis"""

    rate_limit_per_s: PositiveFloat = 50.0
    """requests per tenant: the sustained rate (a token bucket in Redis)"""
    rate_limit_burst: PositiveInt = 200
    """requests per tenant: the burst"""
    rate_limit_credit_hold_s: Annotated[float, Field(ge=0, le=5)] = 5.0
    """an API process takes a tenant's tokens from its bucket a few at a time (at most a tenth
    of the burst) and spends them on its next requests for at most this long, handing back what
    is left; a tenant sending a request every second asks Redis on about a fifth of them (held
    2 s: half; 0.25 s: every one). Over every process a tenant gets at most what its bucket
    allows plus the tokens the processes hold, under (a tenth of the burst) x (API processes),
    whatever this hold; `0`: one Redis round trip per request"""
    anonymous_rate_limit_per_s: PositiveFloat = 5.0
    """per client address: the lab, `/metrics`, `/healthz`, and lookups of keys not yet known
    (each costs a Postgres lookup): the sustained rate"""
    anonymous_rate_limit_burst: PositiveInt = 30
    """per client address, as above: the burst"""

    metrics_cache_s: Annotated[float, Field(ge=0)] = 5.0
    """`/metrics` reads Postgres and the ledger at most once per interval"""
