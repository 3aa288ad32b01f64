"""The engine gate: Backfill's interactive admission inside vLLM's own API server, no proxy hop.

``vllm serve MODEL --api-key $ENGINE_KEY --middleware queue_api.engine_gate.EngineGate``,
with the deployment's ``BACKFILL_*`` settings in the engine's environment (Postgres, Redis,
``BACKFILL_ENGINE_API_KEY`` equal to vLLM's ``--api-key``) and ``BACKFILL_GATE_NODE``, the
node's name as its worker registers it. Tenants then send ``POST /v1/chat/completions`` and
``POST /v1/completions`` with their own Backfill keys straight to the engine's port:

- a request bearing the engine's own key (Backfill's worker, the central gateway) passes on
  untouched: they hold their own reservations;
- a request bearing a tenant's key is checked, parsed, admitted and leased exactly as the
  central gateway does it (:class:`backfill.gateway.admission.InteractiveAdmission`, placed on
  this node only: the tenant's rate limit, caps, the tenant share, bound or exact counts,
  preempting batch for room, waiting within ``X-Backfill-Max-Wait``), then handed to vLLM's
  own handler in the same process with the budget the lease covers, the interactive priority,
  the tenant's ``cache_salt`` and the engine's key; its answer is watched on the way out (the
  tokens of each streamed event, the usage) to settle and end the lease, before the stream's
  ``[DONE]`` reaches the caller;
- anything else on those two paths is a 401; every other path is vLLM's (its key required).

What it saves against the central gateway (``queue_api.gateway``) is a whole HTTP hop: the
API process' accept, its request to the engine and its relay of every event
(``bench.gateway``'s ``engine-gate`` side). What it gives up: placement across nodes (a plain
load balancer in front of the engines places; a node without room answers 429 with
``Retry-After`` once the caller's wait is over).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backfill.config import Settings, get_settings
from backfill.engine.http import HttpEngine, engine_limits
from backfill.errors import BackfillError, StoreUnavailable
from backfill.gateway.admission import Admitted, InteractiveAdmission
from backfill.gateway.leases import used_tokens
from backfill.gateway.refusals import ClientGone, GatewayRefusal
from backfill.keycache import RevocationListener, TenantKeyCache
from backfill.redis_client import connect, connect_async
from backfill.refusals import InvalidRequest
from backfill.store import Repository, TenantRecord
from queue_api import errors
from queue_api import gateway_metrics as m
from queue_api.edge import Gate, build_gate, client_address, load_json_body
from queue_api.errors import Unauthorized
from queue_api.gateway import (
    CLIENT_CLOSED_REQUEST,
    CLIENT_TIMEOUT_HEADER,
    MAX_WAIT_APPLIED_HEADER,
    MAX_WAIT_HEADER,
    NODE_HEADER,
    MetricEvents,
    Relay,
    engine_payload,
    seconds_header,
)
from queue_api.routes.gateway import ENDPOINTS, refusal_response

log = logging.getLogger("backfill.engine_gate")


class GateMisconfigured(RuntimeError):
    """The engine gate cannot start with these settings (one line says why)."""


def check_settings(settings: Settings) -> tuple[str, str]:
    """The gate's node and the engine's key, or :class:`GateMisconfigured`."""
    if not settings.gate_node:
        raise GateMisconfigured(
            "Backfill's engine gate needs BACKFILL_GATE_NODE: the name this engine's worker "
            "registers its node under"
        )
    key = settings.engine_api_key.get_secret_value() if settings.engine_api_key else ""
    if not key:
        raise GateMisconfigured(
            "Backfill's engine gate needs BACKFILL_ENGINE_API_KEY, the engine's own key "
            "(vLLM's --api-key): it is how the worker's requests, which hold their own "
            "reservations, are told from tenants'"
        )
    return settings.gate_node, key


@dataclass
class _Parts:
    """What the gate holds once started (on its first tenant request)."""

    repo: Repository
    gate: Gate
    admission: InteractiveAdmission
    revocations: RevocationListener
    closers: list[Callable[[], Awaitable[None] | None]] = field(default_factory=list)


class EngineGate:
    """ASGI middleware for vLLM's API server (``--middleware``); see the module."""

    def __init__(self, app: ASGIApp, settings: Settings | None = None) -> None:
        self.app = app
        self.settings = settings or get_settings()
        self.node, key = check_settings(self.settings)
        self._engine_key = key.encode()
        self.engine_authorization = f"Bearer {key}".encode()
        self._parts: _Parts | None = None
        self._starting = asyncio.Lock()
        log.info("Backfill's engine gate admits tenants' interactive requests on %s", self.node)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._closing_on_shutdown(send))
            return
        endpoint = ENDPOINTS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        authorization = Headers(scope=scope).get("authorization", "")
        if self._is_engine_key(authorization):
            await self.app(scope, receive, send)  # the worker, the central gateway
            return
        await _Admission(self, scope, receive, send).run(endpoint.value, authorization)

    def _is_engine_key(self, authorization: str) -> bool:
        scheme, _, key = authorization.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            key.strip().encode(), self._engine_key
        )

    async def parts(self) -> _Parts:
        if self._parts is None:
            async with self._starting:
                if self._parts is None:
                    try:
                        self._parts = await anyio.to_thread.run_sync(self._start)
                    except Exception as exc:  # the driver's and the clients' many types
                        log.warning("engine gate: stores not reached: %r", exc)
                        raise StoreUnavailable(f"the engine gate's stores: {exc}") from exc
        return self._parts

    def _start(self) -> _Parts:
        s = self.settings
        repo = Repository.connect(s.database_url, pool_size=2)
        client = connect(s.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        async_client = connect_async(s.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        keys = TenantKeyCache(repo.tenants.tenant_for_key, s.api_key_cache_s)
        subscriber = connect(s.redis_url, socket_connect_timeout=0.5)
        revocations = RevocationListener(subscriber, s.redis_namespace, keys).start()
        engine_client = httpx.AsyncClient(
            timeout=httpx.Timeout(30.0),
            limits=engine_limits(16, 8),
            headers={"Authorization": self.engine_authorization.decode()},
        )
        engines: dict[str, HttpEngine] = {}

        def engine_for(url: str) -> HttpEngine:
            # Counting and context lengths: this engine's own routes, through its own port.
            if url not in engines:
                engines[url] = HttpEngine(url, client=engine_client)
            return engines[url]

        admission = InteractiveAdmission(s, repo, engine_for, events=MetricEvents(), node=self.node)
        parts = _Parts(repo, build_gate(s, keys, client, async_client), admission, revocations)
        parts.closers += [
            admission.aclose,
            engine_client.aclose,
            async_client.aclose,
            revocations.stop,
            subscriber.close,
            client.close,
            repo.close,
        ]
        return parts

    def _closing_on_shutdown(self, send: Send) -> Send:
        async def sending(message: Message) -> None:
            if message["type"] == "lifespan.shutdown.complete" and self._parts is not None:
                for close in self._parts.closers:
                    try:
                        done = close()
                        if done is not None:
                            await done
                    except Exception as exc:  # closing: nothing here may stop the shutdown
                        log.warning("engine gate: closing %r failed: %s", close, exc)
                self._parts = None
            await send(message)

        return sending


class _Admission:
    """One tenant request through the gate: its answer to the caller, whatever happens."""

    def __init__(self, gate: EngineGate, scope: Scope, receive: Receive, send: Send) -> None:
        self.gate = gate
        self.scope = scope
        self.receive = receive
        self.send = send
        self.request = Request(scope, receive)

    async def run(self, path: str, authorization: str) -> None:
        received = time.perf_counter()
        try:
            parts = await self.gate.parts()
            tenant = await self._authenticate(parts.gate, authorization)
            authenticated = time.perf_counter()
            m.HOP_EDGE.observe(authenticated - received)
            admitted, body = await self._admit(parts.admission, path, tenant, authenticated)
        except GatewayRefusal as exc:
            m.REJECTIONS.labels(exc.reason).inc()
            await self._answer(refusal_response(self.request, exc))
            return
        except ClientGone:
            m.REJECTIONS.labels("client_gone").inc()
            await self._answer(Response(status_code=CLIENT_CLOSED_REQUEST))
            return
        except BackfillError as exc:
            if isinstance(exc, InvalidRequest):
                m.REJECTIONS.labels("invalid_request").inc()
            await self._answer(errors.backfill_error_response(exc))
            return
        except _BodyTooLarge as exc:
            response = JSONResponse(
                errors.error_body(str(exc), param="body", code="request_too_large"),
                status_code=413,
                headers={"Connection": "close"},
            )
            await self._answer(response)
            return
        await _Passage(self, admitted, body, tenant, received).run()

    async def _answer(self, response: Response) -> None:
        await response(self.scope, self.receive, self.send)

    async def _authenticate(self, gate: Gate, authorization: str) -> TenantRecord:
        if not authorization:
            raise Unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        tenant = await gate.authenticate_cached(authorization)
        if tenant is None:
            # A thread hop: Postgres (a key not in the cache) and the sync Redis client.
            address = client_address(self.scope)
            tenant = await anyio.to_thread.run_sync(gate.authenticate, authorization, address)
        return tenant

    async def _admit(
        self, admission: InteractiveAdmission, path: str, tenant: TenantRecord, received: float
    ) -> tuple[Admitted, Mapping[str, Any]]:
        body = load_json_body(await self._body(self.gate.settings.max_interactive_body_bytes))
        parsed = await admission.parse(ENDPOINTS[path], body, (tenant.id, tenant.name))
        asked = seconds_header(self.request, MAX_WAIT_HEADER)
        timeout = seconds_header(self.request, CLIENT_TIMEOUT_HEADER)
        budget = admission.wait_budget(asked, timeout)
        if asked is not None and budget < asked:
            self.request.state.backfill_headers = {MAX_WAIT_APPLIED_HEADER: f"{budget:g}"}
        admitted = await admission.admit(
            parsed,
            owner=f"gateway/{tenant.id}",
            max_wait_s=budget,
            disconnected=self.request.is_disconnected,
        )
        m.HOP_PARSE.observe(admitted.counted_at - received)
        reserve = admitted.admitted_at - admitted.counted_at - admitted.waited_s
        m.HOP_RESERVE.observe(max(0.0, reserve))
        return admitted, parsed.body

    async def _body(self, limit: int) -> bytes:
        declared = Headers(scope=self.scope).get("content-length", "")
        if declared.strip().isdigit() and int(declared) > limit:
            raise _BodyTooLarge(limit)
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone("the caller left before its request was read")
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > limit:
                raise _BodyTooLarge(limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class _BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"The request body is larger than the limit of {limit} bytes.")


class _Passage:
    """An admitted request through vLLM's own handler, its answer watched on the way out."""

    def __init__(
        self,
        admission: _Admission,
        admitted: Admitted,
        body: Mapping[str, Any],
        tenant: TenantRecord,
        received: float,
    ) -> None:
        self.outer = admission
        self.admitted = admitted
        self.body = body
        self.tenant = tenant
        shape = admitted.shape
        self.relay = Relay(shape.endpoint.value, received, pending=admitted.pending)
        self.stream = shape.stream
        self.status = 0
        self.buffer = b""
        self.answer = bytearray()
        self.ended = False
        self.sent_at = 0.0

    async def run(self) -> None:
        admitted, settings = self.admitted, self.outer.gate.settings
        shape, keeper = admitted.shape, admitted.keeper
        outcome = "disconnected"
        try:
            raw = json.dumps(engine_payload(settings, self.body, admitted, self.tenant.id)).encode()
            m.GATEWAY_OVERHEAD.labels(shape.endpoint.value).observe(
                (admitted.counted_at - self.relay.received)
                + (time.perf_counter() - admitted.admitted_at)
            )
            self.sent_at = time.perf_counter()
            await self.outer.gate.app(
                self._scope(raw, keeper.lease.lease_id), self._replay(raw), self._watch
            )
            outcome = "completed" if 200 <= self.status < 300 else "engine_error"
        finally:
            with anyio.CancelScope(shield=True):
                await self._end()
            admitted.pending.end()
            m.REQUESTS.labels(shape.endpoint.value, outcome).inc()
            m.REQUEST_DURATION.labels(shape.endpoint.value, str(self.stream).lower()).observe(
                time.perf_counter() - self.relay.received
            )

    def _scope(self, raw: bytes, lease_id: str) -> Scope:
        dropped = {b"authorization", b"content-length", b"transfer-encoding", b"x-request-id"}
        headers = [(k, v) for k, v in self.outer.scope["headers"] if k.lower() not in dropped]
        headers += [
            (b"authorization", self.outer.gate.engine_authorization),
            (b"content-length", str(len(raw)).encode()),
            (b"x-request-id", lease_id.encode()),
        ]
        return {**self.outer.scope, "headers": headers}

    def _replay(self, raw: bytes) -> Receive:
        given = False

        async def receive() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await self.outer.receive()

        return receive

    async def _watch(self, message: Message) -> None:
        send = self.outer.send
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.relay.headers_at = time.perf_counter()
            m.HOP_ENGINE_HEADERS.observe(self.relay.headers_at - self.sent_at)
            extra = [(NODE_HEADER.lower().encode(), self.admitted.node.name.encode())]
            extra += [
                (k.lower().encode(), v.encode())
                for k, v in getattr(self.outer.request.state, "backfill_headers", {}).items()
            ]
            await send({**message, "headers": [*message.get("headers", ()), *extra]})
            return
        if message["type"] != "http.response.body" or self.status != 200:
            await send(message)
            return
        more = bool(message.get("more_body", False))
        body = message.get("body", b"")
        if not self.stream:
            self.answer += body
            if not more:
                self._saw_answer()
            await send(message)
            return
        watched = time.perf_counter()
        data = self.buffer + body
        if more:
            complete, sep, self.buffer = data.rpartition(b"\n\n")
            complete += sep
        else:
            complete, self.buffer = data, b""
        out = await self._events(complete)
        if out or not more:
            await send({**message, "body": out})
            self.relay.handed_on(watched, time.perf_counter())

    async def _events(self, data: bytes) -> bytes:
        """The events of ``data`` as the caller gets them: each seen, the usage-only event
        dropped unless asked for, the lease ended before ``[DONE]`` goes out."""
        kept: list[bytes] = []
        for event in data.split(b"\n\n"):
            if not event.strip():
                continue
            line = event.strip()
            if not line.startswith(b"data:"):
                kept.append(event + b"\n\n")
                continue
            content = line[5:].strip()
            now = time.perf_counter()
            self.relay.received_event(now)
            if content == b"[DONE]":
                self.relay.done = True
                await self._end()  # the room goes back before the caller sees the end
                kept.append(event + b"\n\n")
                continue
            try:
                parsed = json.loads(content)
            except ValueError:
                kept.append(event + b"\n\n")
                continue
            keeper, include_usage = self.admitted.keeper, self.admitted.shape.include_usage
            if not self.relay.leased(parsed, now, keeper, include_usage):
                continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def _saw_answer(self) -> None:
        try:
            usage = json.loads(bytes(self.answer)).get("usage")
        except (ValueError, AttributeError):
            return
        if isinstance(usage, dict):
            self.relay.usage = usage
            self.admitted.keeper.generated = int(usage.get("completion_tokens") or 0)

    async def _end(self) -> None:
        if self.ended:
            return
        self.ended = True
        keeper, sizing, relay = self.admitted.keeper, self.admitted.sizing, self.relay
        if self.status != 200:
            await keeper.end(None)
            return
        if self.stream:
            await relay.settle(keeper, sizing)
            return
        keeper.check_bound(sizing, relay.usage)
        used = used_tokens(keeper.exact or sizing, relay.usage, keeper.generated)
        # A whole answer without its usage settles nothing (as the central gateway's).
        await keeper.end(used if relay.usage else None)
