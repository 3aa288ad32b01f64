"""The queue's clocks and claims: how long a worker's lease lives and how often it is renewed,
how often the maintenance tick runs, and how workers claim items and share nodes among tenants."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, model_validator

from backfill.config.fields import PositiveFloat, PositiveInt


class QueueSettings(BaseModel):
    """Leases, the maintenance tick, and claiming."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    lease_ttl_s: PositiveFloat = 30.0
    """a silent worker's items are requeued after this TTL + one reaper interval at most"""
    heartbeat_interval_s: PositiveFloat = 5.0
    """each beat renews every lease in the ledger and rewrites a claim in Postgres only once it
    was extended more than half the TTL less 1.5 beats ago (every other beat at the defaults);
    the two beat on clocks of their own, so a slow ledger does not hold up the claims, nor a
    slow Postgres the leases. Under half of `BACKFILL_LEASE_TTL_S`: two missed beats must not
    lose a live lease"""
    reaper_interval_s: PositiveFloat = 5.0
    """how often the maintenance tick runs (reaps silent attempts, expires, finalizes, purges)"""
    stale_validating_s: PositiveFloat = 600.0
    """a batch checked in its create's request and still `validating` this long with no create
    at work on it (its API process died) is moved on by the maintenance tick (a deferred create
    is left to the ingest processes)"""

    claim_batch_size: PositiveInt = 64
    """items a worker claims from Postgres at once"""
    fair_share: bool = True
    """tenants share each node by weight, and deadlines are judged at the tenant's share
    (`false`: earliest deadline first across all tenants, every tenant's backlog ahead of a new
    batch; `backfill.fairshare`)"""

    @model_validator(mode="after")
    def _lease_timing(self) -> Self:
        # Two missed heartbeats must not lose a live lease; otherwise healthy workers would see
        # their reservations reaped under ordinary scheduling jitter.
        if self.heartbeat_interval_s * 2 >= self.lease_ttl_s:
            raise ValueError(
                "BACKFILL_HEARTBEAT_INTERVAL_S must be less than half of BACKFILL_LEASE_TTL_S "
                f"(got {self.heartbeat_interval_s} and {self.lease_ttl_s})"
            )
        return self
