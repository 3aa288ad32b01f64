"""The interactive gateway: ``POST /v1/chat/completions`` and ``POST /v1/completions``,
OpenAI-compatible (stream and not), admitted against the interactive pool and proxied to a
node's vLLM server.

Headers the gateway reads: ``X-Backfill-Max-Wait`` (seconds the caller will wait for room; 0
answers at once; at most ``BACKFILL_GATEWAY_MAX_WAIT_CAP_S``). Headers it sets:
``X-Backfill-Node`` (the node that served the request), ``Retry-After`` on 429 and 503, and
``X-Backfill-Max-Wait-Applied`` (the seconds it waited at most, when less than asked).

Every interactive request crosses these two routes, so they are served straight from the
request edge (:class:`GatewayFastPath`), past FastAPI's router, dependency solving and
exception middleware: the same handler and the same answers, ~0.5 ms less of the API's
interpreter per request on a shared core. The FastAPI routes below stay: they describe the
routes in the OpenAPI schema, and serve an app built without the edge.
"""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from backfill.errors import BackfillError
from backfill.gateway.refusals import (
    ContextLengthExceeded,
    GatewayRefusal,
    ModelNotServed,
    NoInteractiveRoom,
    OverRequestCap,
    ReservationTooLarge,
)
from backfill.gateway.request import InteractiveEndpoint
from queue_api import errors
from queue_api.deps import TenantDep
from queue_api.edge import TENANT_STATE
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


def refusal_response(request: Request, exc: Exception) -> JSONResponse:
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


ENDPOINTS = {endpoint.value: endpoint for endpoint in InteractiveEndpoint}
"""The gateway's paths and what each serves."""


class GatewayFastPath:
    """ASGI middleware, inside the request edge: a ``POST`` to a gateway path whose caller the
    edge has authenticated goes straight to the gateway's handler; anything else (another
    route, another method, an app without a gateway) goes on to the app.

    The answers are the app's own: the gateway's refusals as :func:`refusal_response` makes them,
    Backfill's errors and HTTP errors (a body over its limit) as the app's handlers do, and
    anything unexpected raised on to the app's last-resort handler."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        tenant = scope.get("state", {}).get(TENANT_STATE)
        gateway = getattr(scope["app"].state, "gateway", None) if tenant is not None else None
        if endpoint is None or scope["method"] != "POST" or gateway is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        response: Response
        try:
            response = await gateway.handle(endpoint, request, tenant)
        except GatewayRefusal as exc:
            response = refusal_response(request, exc)
        except BackfillError as exc:
            response = errors.backfill_error_response(exc)
        except HTTPException as exc:
            response = errors.http_error_response(request, exc)
        await response(scope, receive, send)


def install(app: FastAPI) -> None:
    """The routes, the answers for the gateway's refusals, and the fast path (installed
    before the request edge, so the edge wraps it)."""
    app.include_router(router)
    app.add_exception_handler(GatewayRefusal, refusal_response)
    app.add_middleware(GatewayFastPath)
