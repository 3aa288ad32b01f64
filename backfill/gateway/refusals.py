"""The interactive gateway's refusals: the API edge maps each class to an HTTP status; the core
knows none.
"""

from __future__ import annotations

from backfill.errors import BackfillError
from backfill.refusals import Refusal


class GatewayRefusal(Refusal):
    """Base of the gateway's refusals; ``reason`` labels the rejection metric."""

    reason = "refused"


class ContextLengthExceeded(GatewayRefusal):
    """``prompt + max_output`` is over what the interactive class (or the model) allows."""

    default_code = "context_length_exceeded"

    def __init__(self, message: str, *, stage: str, limit: int | None, param: str | None) -> None:
        super().__init__(message, param=param)
        self.stage = stage
        """``bound`` (refused before tokenizing) or ``exact`` (after counting)."""
        self.limit = limit
        self.reason = f"context_length_{stage}"


class ReservationTooLarge(GatewayRefusal):
    """The reservation is larger than any serving node's pool could ever hold."""

    default_code = "reservation_larger_than_pool"
    reason = "larger_than_pool"


class OverRequestCap(GatewayRefusal):
    """The request asks for more than one interactive request may: sequences, or tokens
    reserved over all of them (``RequestCaps``)."""

    default_code = "interactive_request_cap_exceeded"
    reason = "over_request_cap"

    def __init__(self, message: str, *, param: str, limit: int) -> None:
        super().__init__(message, param=param)
        self.limit = limit


class ModelNotServed(GatewayRefusal):
    """No registered node serves the requested model."""

    default_code = "model_not_found"
    reason = "model_not_served"


class NoInteractiveRoom(GatewayRefusal):
    """Every serving node is full, even counting what preempting batch would free, for as long
    as the caller was willing to wait."""

    default_code = "interactive_capacity_exhausted"
    reason = "no_room"


class TenantShareExceeded(NoInteractiveRoom):
    """The caller's tenant holds its share of every serving node it could use
    (``BACKFILL_GATEWAY_TENANT_SHARE``), for as long as the caller was willing to wait: its
    own requests must end first, whatever room other tenants have. A 429, as a full pool is,
    with a code of its own."""

    default_code = "tenant_interactive_share"
    reason = "tenant_share"


class GatewayUnavailable(GatewayRefusal):
    """The gateway cannot admit now for reasons other than load: the ledger is down or being
    rebuilt, or no serving engine answers."""

    default_code = "service_unavailable"
    reason = "unavailable"


class ClientGone(BackfillError):
    """The caller disconnected while its request waited for room."""
