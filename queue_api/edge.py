"""The request edge: what a request may cost is settled before any route sees it.

Per route (:func:`route_rules`, a pure function of method, path and query):

- **Body size**, counted on the bytes actually read, not only on ``Content-Length`` (a
  chunked body declares no length): an upload may carry ``max_file_bytes`` and its multipart
  envelope, an interactive request ``max_interactive_body_bytes``, every other JSON route
  ``max_json_body_bytes``. A declared length over the limit is refused before reading; a body
  that grows past it is cut off at the first chunk over (413, and the connection is closed
  rather than drained).
- **The key**, for every ``/v1/`` route: checked, with the tenant's rate limit, before one
  byte of the body is read, so a caller without a valid key never makes the API read, parse
  or spool a body. A request costs one token of the rate limit, but a page of files a token
  per 500 files (OpenAI's default page, 10,000 files, costs 20: the store and the API spend
  ~30 ms on it, 28 of them Postgres', what they spend on ~20 small reads).
- **Anonymous work** (the capacity lab, ``/metrics``, ``/healthz``) is rate-limited per
  client address, and so is every key lookup that only Postgres can answer (a key not in the
  key cache), so guessing keys costs the guesser, not the database.

- **A request id** on every answer (``x-request-id: req_...``, as OpenAI's), refusals of the
  edge included; routes find it in the request's state (``REQUEST_ID_STATE``) for logs.

The address is the connection's peer as the server reports it (``--proxy-headers`` in
uvicorn makes that the client's behind a trusted proxy; otherwise every caller behind a
proxy shares one bucket).
"""

from __future__ import annotations

import json
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

import anyio
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.config import Settings
from backfill.errors import BackfillError
from backfill.keycache import TenantKeyCache
from backfill.ratelimit import RateDecision, RateLimiter
from backfill.redis_client import AsyncRedis, SyncRedis
from backfill.refusals import InvalidRequest, RateLimited
from backfill.store import TenantRecord
from queue_api import errors
from queue_api.errors import Unauthorized
from queue_api.tenant_turns import TenantTurns

MULTIPART_OVERHEAD = 64 * 1024
"""Room for the multipart envelope around a file of the maximum size."""

TENANT_STATE = "backfill.tenant"
"""Where the edge leaves the authenticated tenant in the request's state."""

REQUEST_ID_STATE = "backfill.request_id"
"""Where the edge leaves the request's id (also sent back as ``x-request-id``)."""

ACCEPTED_STATE = "backfill.accepted"
"""Where the edge leaves ``time.perf_counter()`` as the request reached it (the gateway's
hop account starts there)."""

UPLOAD_PATH = "/v1/files"
FILES_PAGE_MAX = 10_000
"""The largest page of files (OpenAI's default page; ``queue_api.routes.files``)."""
FILES_PER_RATE_TOKEN = 500
"""Files on a page that cost one token of the tenant's rate limit (at 1,000, one tenant's
list loops under the default limit still raised another's read p99 ~0.5x more: issue 35)."""
INTERACTIVE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
SUMMARY_JOBS_PATH = "/v1/summary_jobs/"
"""A summarisation job's documents (``.../{id}/documents``) come in pages as large as an
upload."""
ANONYMOUS_LIMITED = ("/lab/", "/metrics", "/healthz")
"""Routes that answer without a key but do work (compute, Postgres, Redis)."""

MAX_JSON_DEPTH = 64
"""Nesting a JSON body may have (OpenAI request bodies, tool schemas included, need a
fraction of it); deeper is refused as a 400 before anything walks it."""


@dataclass(frozen=True, slots=True)
class BodyLimits:
    upload_bytes: int
    interactive_bytes: int
    json_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> BodyLimits:
        return cls(
            upload_bytes=settings.max_file_bytes + MULTIPART_OVERHEAD,
            interactive_bytes=settings.max_interactive_body_bytes,
            json_bytes=settings.max_json_body_bytes,
        )


@dataclass(frozen=True, slots=True)
class RouteRules:
    max_body_bytes: int
    needs_key: bool
    anonymous_limited: bool
    body_param: str | None = None
    """What an oversized body is called in the error (``file`` for uploads)."""
    takes_turns: bool = False
    """Under the tenant's bound on requests in progress (:mod:`backfill.tenant_requests`):
    every ``/v1/`` route but the streamed bodies (uploads, summary documents: a slow sender
    would hold a place for minutes; the ingest slots bound them) and the interactive
    gateway (its requests mostly wait on an engine, and the gateway admits them itself)."""
    rate_cost: int = 1
    """Tokens of the tenant's rate limit the request costs."""


def route_rules(method: str, path: str, limits: BodyLimits, query: bytes = b"") -> RouteRules:
    """The rules of one request, from its method, path and query string alone."""
    if path == "/v1" or path.startswith("/v1/"):
        if method == "POST" and path == UPLOAD_PATH:
            return RouteRules(limits.upload_bytes, True, False, "file")
        if method == "GET" and path == UPLOAD_PATH:
            cost = files_page_cost(query)
            return RouteRules(limits.json_bytes, True, False, takes_turns=True, rate_cost=cost)
        if path in INTERACTIVE_PATHS:
            return RouteRules(limits.interactive_bytes, True, False)
        if method == "POST" and path.startswith(SUMMARY_JOBS_PATH) and path.endswith("/documents"):
            return RouteRules(limits.upload_bytes, True, False, "documents")
        return RouteRules(limits.json_bytes, True, False, takes_turns=True)
    limited = any(path == p.rstrip("/") or path.startswith(p) for p in ANONYMOUS_LIMITED)
    return RouteRules(limits.json_bytes, False, limited)


def files_page_cost(query: bytes) -> int:
    """Rate tokens of a page of files: a token per 500 files it may list (a ``limit`` that
    is not a number costs one: the route refuses it)."""
    asked = parse_qs(query.decode("latin-1")).get("limit", [str(FILES_PAGE_MAX)])[-1]
    try:
        limit = min(max(int(asked), 1), FILES_PAGE_MAX)
    except ValueError:
        return 1
    return math.ceil(limit / FILES_PER_RATE_TOKEN)


class BodyTooLarge(HTTPException):
    """A request body over its route's limit (an HTTPException, so that FastAPI's body
    parsing passes it on instead of calling it a malformed body)."""

    def __init__(self, limit: int, param: str | None, declared: int | None = None) -> None:
        size = f"of {declared} bytes " if declared is not None else ""
        super().__init__(
            413,
            f"request body {size}is over this route's limit of {limit} bytes",
            headers={"Connection": "close"},
        )
        self.param = param
        self.code = "file_too_large" if param == "file" else "request_too_large"


class Gate:
    """Who is calling, and whether they may now: keys through the key cache, tenants' rate
    limits, and the per-address limit of anonymous work. Blocking (Postgres on a cache
    miss, Redis): call it from a worker thread."""

    def __init__(self, keys: TenantKeyCache, tenants: RateLimiter, anonymous: RateLimiter) -> None:
        self.keys = keys
        self.tenants = tenants
        self.anonymous = anonymous

    def authenticate(self, authorization: str, address: str, cost: int = 1) -> TenantRecord:
        """The caller's tenant, whose rate limit pays ``cost`` tokens for the request."""
        key = _bearer(authorization)
        known, tenant = self.keys.cached(key)
        if not known:
            self.admit_anonymous(address)
            tenant = self.keys.get(key)
        if tenant is None:
            raise Unauthorized("Incorrect API key provided.")
        _allowed(self.tenants.check(tenant.id, cost))
        return tenant

    async def authenticate_cached(self, authorization: str, cost: int = 1) -> TenantRecord | None:
        """:meth:`authenticate` on the event loop, for a key the key cache knows (its rate
        limit checked through the asyncio client); None when only Postgres can tell (or no
        asyncio client was given): then :meth:`authenticate`, in a worker thread."""
        if not self.tenants.checks_async:
            return None
        key = _bearer(authorization)
        known, tenant = self.keys.cached(key)
        if not known:
            return None
        if tenant is None:
            raise Unauthorized("Incorrect API key provided.")
        _allowed(await self.tenants.acheck(tenant.id, cost))
        return tenant

    def admit_anonymous(self, address: str) -> None:
        decision = self.anonymous.check(f"anon:{address}")
        if not decision.allowed:
            raise RateLimited(
                "Too many requests without a known API key from this address; retry after "
                "the time in Retry-After.",
                retry_after_s=decision.retry_after_s,
            )


def build_gate(
    settings: Settings, keys: TenantKeyCache, client: SyncRedis, async_client: AsyncRedis
) -> Gate:
    """The API's front gate: keys, the tenants' rate limit and the anonymous one."""
    namespace = settings.redis_namespace
    return Gate(
        keys,
        RateLimiter(
            client,
            namespace,
            settings.rate_limit_per_s,
            settings.rate_limit_burst,
            async_client=async_client,
            credit_hold_s=settings.rate_limit_credit_hold_s,
        ),
        RateLimiter(
            client,
            namespace,
            settings.anonymous_rate_limit_per_s,
            settings.anonymous_rate_limit_burst,
        ),
    )


def _bearer(authorization: str) -> str:
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthorized(
            "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
        )
    return key


def _allowed(decision: RateDecision) -> None:
    if not decision.allowed:
        raise RateLimited(
            "Too many requests for this tenant; retry after the time in Retry-After.",
            retry_after_s=decision.retry_after_s,
        )


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


class RequestEdge:
    """ASGI middleware applying :func:`route_rules` to every HTTP request."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.limits = BodyLimits.from_settings(settings)
        bound = settings.tenant_requests_in_progress
        self.turns = TenantTurns(bound) if bound else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        state = scope.setdefault("state", {})
        state[ACCEPTED_STATE] = time.perf_counter()
        state[REQUEST_ID_STATE] = request_id
        send = _with_request_id(send, request_id)
        rules = route_rules(
            scope["method"], scope["path"], self.limits, scope.get("query_string", b"")
        )
        headers = Headers(scope=scope)
        declared = _declared_length(headers)
        if declared is not None and declared > rules.max_body_bytes:
            error = BodyTooLarge(rules.max_body_bytes, rules.body_param, declared)
            await errors.body_too_large(error)(scope, receive, send)
            return
        gate: Gate | None = getattr(scope["app"].state, "gate", None)
        turn: tuple[TenantTurns, str] | None = None
        if gate is not None and (rules.needs_key or rules.anonymous_limited):
            authorization = headers.get("authorization", "")
            try:
                tenant = (
                    await gate.authenticate_cached(authorization, rules.rate_cost)
                    if rules.needs_key
                    else None
                )
                if tenant is None:
                    # A thread hop: Postgres (a key not in the cache) and the sync Redis client.
                    tenant = await anyio.to_thread.run_sync(
                        _pass, gate, rules, authorization, client_address(scope)
                    )
                if tenant is not None and rules.takes_turns and self.turns is not None:
                    # Beyond the tenant's bound, wait in its own queue (no thread, no CPU).
                    await self.turns.wait_for_turn(tenant.id)
                    turn = (self.turns, tenant.id)
            except BackfillError as exc:
                response = errors.backfill_error_response(exc)
                if declared or "chunked" in headers.get("transfer-encoding", ""):
                    # The body is not wanted: close the connection instead of draining it.
                    response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
            if tenant is not None:
                scope.setdefault("state", {})[TENANT_STATE] = tenant
        if turn is None:
            await self.app(scope, _limited(receive, rules), send)
            return
        turns, tenant_id = turn
        try:
            await self.app(scope, _limited(receive, rules), send)
        finally:
            turns.done(tenant_id)


def new_request_id() -> str:
    """A request id in OpenAI's shape (``req_`` and 32 hex digits)."""
    return f"req_{secrets.token_hex(16)}"


def _with_request_id(send: Send, request_id: str) -> Send:
    raw = (b"x-request-id", request_id.encode("ascii"))

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", ()) if h[0].lower() != raw[0]]
            message = {**message, "headers": [*headers, raw]}
        await send(message)

    return sending


def _pass(gate: Gate, rules: RouteRules, authorization: str, address: str) -> TenantRecord | None:
    if rules.needs_key:
        return gate.authenticate(authorization, address, rules.rate_cost)
    gate.admit_anonymous(address)
    return None


def load_json_body(raw: bytes) -> Any:
    """A JSON request body, or InvalidRequest (400) for one that is not JSON or is nested
    deeper than :data:`MAX_JSON_DEPTH` (deeper than the parser's recursion limit would be a
    RecursionError, and code walking a body recursively could hit it later)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise InvalidRequest(
            f"the request body is nested deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    except ValueError:
        raise InvalidRequest("the request body is not valid JSON") from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels")
    return body


def json_depth(value: Any, stop_at: int = MAX_JSON_DEPTH) -> int:
    """How deeply ``value`` nests arrays and objects (a scalar is 0), counted without
    recursion; the walk stops once past ``stop_at``."""
    deepest = 0
    level: list[Any] = [value]
    depth = 0
    while level and depth <= stop_at:
        children: list[Any] = []
        for node in level:
            if isinstance(node, dict):
                children.extend(node.values())
            elif isinstance(node, list):
                children.extend(node)
        if not children and not any(isinstance(n, dict | list) for n in level):
            break
        depth += 1
        deepest = depth
        level = children
    return deepest


def _declared_length(headers: Headers) -> int | None:
    raw = headers.get("content-length")
    if raw is None or not raw.strip().isdigit():
        return None
    return int(raw)


def _limited(receive: Receive, rules: RouteRules) -> Receive:
    seen = 0

    async def receive_within_limit() -> Message:
        nonlocal seen
        message: Any = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > rules.max_body_bytes:
                raise BodyTooLarge(rules.max_body_bytes, rules.body_param)
        return message  # type: ignore[no-any-return]

    return receive_within_limit
