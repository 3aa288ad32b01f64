"""Why Backfill refuses a request, as values the API edge turns into HTTP answers.

The core raises these; it knows nothing of status codes. Each carries OpenAI's error fields
(``code``, ``param``) and, where waiting helps, how long to wait.
"""

from __future__ import annotations

from backfill.errors import BackfillError, Conflict, InvalidInput, NotFound


class Refusal(BackfillError):
    """Base of every deliberate refusal; ``code`` and ``param`` follow OpenAI's error object."""

    default_code = "invalid_request"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.param = param
        self.retry_after_s = retry_after_s


class InvalidRequest(Refusal, InvalidInput):
    """The request itself is wrong (bad parameter, wrong purpose, malformed value)."""


class ModelNotFound(Refusal, NotFound):
    """The batch names a model no live node serves."""

    default_code = "model_not_found"


class PayloadTooLarge(Refusal, InvalidInput):
    """The upload is larger than the configured limit."""

    default_code = "file_too_large"


class DeadlineInfeasible(InvalidRequest):
    """The window cannot be met given the backlog; ``earliest_window`` could be."""

    default_code = "deadline_infeasible"

    def __init__(self, message: str, *, earliest_window: str, estimated_completion: int) -> None:
        super().__init__(message, param="completion_window")
        self.earliest_window = earliest_window
        self.estimated_completion = estimated_completion


class LimitReached(Refusal):
    """A per-tenant count limit (active batches) is reached; it clears as batches finish."""

    default_code = "active_batch_limit_reached"


class StorageCapReached(LimitReached):
    """The tenant stores as many items or input bytes as it may (finished work counts until
    it is purged); it clears as files are deleted and ended batches purged."""

    default_code = "storage_cap_reached"


class QuotaExceeded(Refusal):
    """The tenant's enqueued-token quota would be exceeded."""

    default_code = "enqueued_token_quota_exceeded"


class RateLimited(Refusal):
    """Too many requests from this tenant right now; retry after ``retry_after_s``."""

    default_code = "rate_limit_exceeded"


class NotCancellable(Refusal, Conflict):
    """The batch is already past the point where cancel means anything."""

    default_code = "batch_not_cancellable"


class IdempotencyMismatch(Refusal, Conflict):
    """An ``Idempotency-Key`` was reused with different parameters."""

    default_code = "idempotency_key_reused"
