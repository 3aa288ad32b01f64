"""The interactive gateway: ``POST /v1/chat/completions`` and ``POST /v1/completions``,
OpenAI-compatible (stream and not), admitted against the interactive pool and proxied to a
node's vLLM server.

Headers the gateway reads: ``X-Backfill-Max-Wait`` (seconds the caller will wait for room; 0
answers at once; at most ``BACKFILL_GATEWAY_MAX_WAIT_CAP_S``). Headers it sets:
``X-Backfill-Node`` (the node that served the request), ``Retry-After`` on 429 and 503, and
``X-Backfill-Max-Wait-Applied`` (the seconds it waited at most, when less than asked).
"""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from backfill.gateway.refusals import (
    ContextLengthExceeded,
    GatewayRefusal,
    ModelNotServed,
    NoInteractiveRoom,
    OverRequestCap,
    ReservationTooLarge,
)
from backfill.gateway.request import InteractiveEndpoint
from queue_api.deps import TenantDep
from queue_api.errors import error_body
from queue_api.gateway import InteractiveGateway, answer_headers

router = APIRouter(prefix="/v1", tags=["gateway"])


async def get_gateway(request: Request) -> InteractiveGateway:
    gateway: InteractiveGateway = request.app.state.gateway
    return gateway


GatewayDep = Annotated[InteractiveGateway, Depends(get_gateway)]


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request, tenant: TenantDep, gateway: GatewayDep) -> Response:
    return await gateway.handle(InteractiveEndpoint.CHAT_COMPLETIONS, request, tenant)


@router.post("/completions", response_model=None)
async def completions(request: Request, tenant: TenantDep, gateway: GatewayDep) -> Response:
    return await gateway.handle(InteractiveEndpoint.COMPLETIONS, request, tenant)


def _refusal(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayRefusal)
    headers = answer_headers(request)
    type_ = "invalid_request_error"
    if isinstance(exc, OverRequestCap | ContextLengthExceeded):
        # As at OpenAI: a prompt over the context is a 400 the SDK raises as BadRequestError.
        status = 400
    elif isinstance(exc, ReservationTooLarge):
        status = 413
    elif isinstance(exc, ModelNotServed):
        status = 404
    elif isinstance(exc, NoInteractiveRoom):
        status, type_ = 429, "requests"
    else:
        status, type_ = 503, "server_error"
    if status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s or 1)))
    body = error_body(exc.message, type_=type_, param=exc.param, code=exc.code)
    if isinstance(exc, ContextLengthExceeded | OverRequestCap) and exc.limit is not None:
        body["error"]["limit"] = exc.limit
    return JSONResponse(body, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """The routes and the answers for the gateway's refusals."""
    app.include_router(router)
    app.add_exception_handler(GatewayRefusal, _refusal)
