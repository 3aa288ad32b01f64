"""Webhook delivery (`backfill.webhooks`): where a target may be, one attempt's limit, retries,
the senders' claims and leases, when a failing endpoint is disabled, and the keys that seal
signing secrets at rest."""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict, SecretStr, field_validator, model_validator

from backfill.config.fields import PositiveFloat, PositiveInt
from backfill.webhooks.sealing import parse_keys


class WebhookSettings(BaseModel):
    """Webhook endpoints and their sender."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    webhooks_allow_private: bool = False
    """allow webhook targets on loopback, private and link-local addresses"""
    webhooks_timeout_s: PositiveFloat = 10.0
    """one delivery attempt's limit, in all: connect, send and the answer's headers together (a
    receiver that drips its answer is cut off there)"""
    webhooks_retry_base_s: PositiveFloat = 5.0
    """the first retry's wait (doubling, jittered)"""
    webhooks_retry_max_delay_s: PositiveFloat = 3600.0
    """the longest wait between retries"""
    webhooks_retry_for_s: PositiveFloat = 24 * 3600.0
    """how long after the event a delivery is retried before it is failed"""
    webhooks_poll_s: PositiveFloat = 1.0
    """how often an idle sender looks for due deliveries (retries that came due; a batch's end
    wakes it at once through `NOTIFY backfill_webhooks`)"""
    webhooks_claim_batch: PositiveInt = 64
    """how many deliveries a sender sends at once (it claims again as each send ends, endpoints
    taking turns at the free slots)"""
    webhooks_per_endpoint: PositiveInt = 2
    """attempts one sender has in flight to one endpoint at most: a slow or dripping endpoint
    holds this many send slots, never all of them; endpoints whose attempts are failing come
    after healthy ones and hold at most half the slots"""
    webhooks_per_tenant: PositiveInt = 16
    """attempts one sender has in flight to one tenant's endpoints at most (a quarter of the
    default slots): a tenant's many endpoints, slow or busy, leave the other slots to other
    tenants, who take turns with it at the free ones"""
    webhooks_disable_after_s: PositiveFloat = 5 * 86_400.0
    """an endpoint whose every attempt has failed for this long is disabled (`status:
    "disabled"` and `disabled_reason` on the endpoint object; nothing is sent to it) until its
    tenant enables it again (`client.webhooks.update(id, extra_body={"status": "enabled"})`, or
    a new `url`)"""
    webhooks_lease_s: PositiveFloat = 60.0
    """how long a claimed delivery is its sender's (more than twice the timeout): then another
    sender takes it, so one that died mid-send is redelivered, with the same webhook-id"""
    webhooks_max_endpoints: PositiveInt = 16
    """webhook endpoints per tenant"""
    webhooks_secret_keys: SecretStr | None = None
    """keys that seal webhook signing secrets at rest (Fernet; `backfill webhooks new-key`),
    comma-separated: the first seals, every one opens; rotate by putting a new one first (the
    sender reseals every endpoint, then the old key can go). Unset: secrets are stored in clear,
    with a warning at start; compose and the Kubernetes overlays require it"""

    @property
    def webhooks_seal_keys(self) -> tuple[str, ...]:
        """The keys that seal webhook signing secrets, the sealing one first (none: clear)."""
        keys = self.webhooks_secret_keys
        return parse_keys(keys.get_secret_value()) if keys is not None else ()

    @field_validator("webhooks_secret_keys")
    @classmethod
    def _webhooks_secret_keys(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            parse_keys(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _webhook_lease(self) -> Self:
        # A sender must finish a send (connect, TLS, answer) well inside its lease, or a
        # second sender takes the delivery while the first is still at it.
        if self.webhooks_timeout_s * 2 >= self.webhooks_lease_s:
            raise ValueError(
                "BACKFILL_WEBHOOKS_TIMEOUT_S must be less than half of BACKFILL_WEBHOOKS_LEASE_S "
                f"(got {self.webhooks_timeout_s} and {self.webhooks_lease_s})"
            )
        return self
