"""Every error leaves in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

The core raises Backfill's own error types; this module is the one place that knows which
HTTP status and OpenAI error type each becomes.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from backfill.errors import (
    BackfillError,
    Conflict,
    InvalidInput,
    NotFound,
    StaleWrite,
    StoreUnavailable,
)
from backfill.refusals import (
    DeadlineInfeasible,
    LimitReached,
    ModelNotFound,
    PayloadTooLarge,
    QuotaExceeded,
    RateLimited,
    Refusal,
)

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
STORE_RETRY_AFTER_S = 5


class Unauthorized(BackfillError):
    """No API key, or one that matches no live key."""

    def __init__(self, message: str, code: str = "invalid_api_key") -> None:
        super().__init__(message)
        self.code = code


def error_body(
    message: str, *, type_: str = INVALID_REQUEST, param: str | None = None, code: str | None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _answer(
    status: int,
    message: str,
    *,
    type_: str = INVALID_REQUEST,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
    extra: dict[str, Any] | None = None,
) -> JSONResponse:
    body = error_body(message, type_=type_, param=param, code=code)
    body["error"].update(extra or {})
    return JSONResponse(body, status_code=status, headers=headers)


# Refusals that waiting alone will not clear soon: tell the openai SDK not to retry them.
_NO_RETRY = {"x-should-retry": "false"}


def _refusal(exc: Refusal) -> JSONResponse:
    if isinstance(exc, RateLimited):
        wait = str(max(1, math.ceil(exc.retry_after_s or 1)))
        return _answer(
            429, exc.message, type_="requests", code=exc.code, headers={"Retry-After": wait}
        )
    if isinstance(exc, QuotaExceeded):
        return _answer(
            429, exc.message, type_="insufficient_quota", code=exc.code, headers=_NO_RETRY
        )
    if isinstance(exc, LimitReached):
        return _answer(429, exc.message, type_="requests", code=exc.code, headers=_NO_RETRY)
    if isinstance(exc, PayloadTooLarge):
        return _answer(413, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, DeadlineInfeasible):
        return _answer(
            400,
            exc.message,
            param=exc.param,
            code=exc.code,
            extra={
                "earliest_feasible_window": exc.earliest_window,
                "estimated_completion_at": exc.estimated_completion,
            },
        )
    if isinstance(exc, Conflict):
        return _answer(409, exc.message, param=exc.param, code=exc.code, headers=_NO_RETRY)
    if isinstance(exc, ModelNotFound):
        return _answer(404, exc.message, param=exc.param, code=exc.code)
    return _answer(400, exc.message, param=exc.param, code=exc.code)


def _backfill_error(_: Request, exc: Exception) -> JSONResponse:
    return backfill_error_response(exc)


def backfill_error_response(exc: Exception) -> JSONResponse:
    """The answer to one of Backfill's own errors (also for the request edge, which answers
    before any route runs)."""
    if isinstance(exc, Refusal):
        return _refusal(exc)
    if isinstance(exc, Unauthorized):
        return _answer(401, str(exc), code=exc.code)
    if isinstance(exc, NotFound):
        return _answer(404, str(exc), param=exc.param, code="not_found")
    if isinstance(exc, StaleWrite | Conflict):
        # The same request would clash again: the openai SDK retries 409s unless told not to.
        return _answer(409, str(exc), code="conflict", headers=_NO_RETRY)
    if isinstance(exc, InvalidInput):
        return _answer(400, str(exc), code="invalid_request")
    if isinstance(exc, StoreUnavailable):
        log.warning("store unavailable: %s", exc)
        return _answer(
            503,
            "The service's store is unavailable; retry shortly.",
            type_="server_error",
            code="store_unavailable",
            headers={"Retry-After": str(STORE_RETRY_AFTER_S)},
        )
    log.error("unhandled Backfill error: %r", exc)
    return _answer(500, "Internal error.", type_="server_error", code="internal_error")


def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    return http_error_response(request, exc)


def http_error_response(request: Request, exc: HTTPException) -> JSONResponse:
    """The answer to an HTTP error (a route's, or the request edge's body limit)."""
    if exc.status_code == 404 and exc.detail == "Not Found":
        message = f"Invalid URL ({request.method} {request.url.path})"
    else:
        message = str(exc.detail)
    if exc.status_code == 413:
        return body_too_large(exc)
    headers = dict(exc.headers) if exc.headers else None
    code = "not_found" if exc.status_code == 404 else None
    return _answer(exc.status_code, message, code=code, headers=headers)


def body_too_large(exc: HTTPException) -> JSONResponse:
    """A body over its route's limit (``queue_api.edge.BodyTooLarge``): the connection is
    closed after the answer, so the rest of the body is never read."""
    return _answer(
        413,
        str(exc.detail),
        param=getattr(exc, "param", None),
        code=getattr(exc, "code", "request_too_large"),
        headers=dict(exc.headers or {}),
    )


def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if param:
        message = f"{param}: {message}"
    return _answer(400, message, param=param, code="invalid_request")


def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return _answer(500, "Internal error.", type_="server_error", code="internal_error")


def install(app: FastAPI) -> None:
    app.add_exception_handler(BackfillError, _backfill_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _unexpected)
