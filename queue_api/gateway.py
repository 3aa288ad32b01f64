"""The interactive gateway's HTTP side: read the request, admit it through the core
(:class:`backfill.gateway.admission.InteractiveAdmission`: nodes, bound or exact count, the
lease), proxy it to the chosen node's vLLM server, relay its answer, and count it all in the
gateway's metrics. It decides nothing.

Streams are relayed event by event as the engine sends them. Every way out of a relay
(finished, engine error, the caller disconnecting, the server stopping) closes the upstream
response, which makes vLLM abort the request and free its KV blocks, and then settles and
releases the lease, shielded from the cancellation that ended the relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from backfill.cache_salt import cache_salt
from backfill.clock import HostClock
from backfill.config import Settings
from backfill.engine.http import HttpEngine, engine_limits, sse_lines
from backfill.gateway.admission import Admitted, InteractiveAdmission
from backfill.gateway.leases import LeaseKeeper, used_tokens
from backfill.gateway.placement import Admission
from backfill.gateway.refusals import ClientGone, GatewayRefusal, GatewayUnavailable
from backfill.gateway.request import InteractiveEndpoint, RequestShape
from backfill.gateway.sizing import Sizing, upstream_body
from backfill.refusals import InvalidRequest
from backfill.store import Repository, TenantRecord
from backfill.work_signals import PendingInteractive
from queue_api import gateway_metrics as m
from queue_api.edge import ACCEPTED_STATE, load_json_body

log = logging.getLogger("backfill.gateway")

MAX_WAIT_HEADER = "x-backfill-max-wait"
"""Seconds the caller will wait for room (0: answer at once). Without it the deployment's
``gateway_max_wait_s`` applies; either way at most ``gateway_max_wait_cap_s`` and half the
openai SDK's read timeout (``x-stainless-read-timeout``), so a refusal arrives before the
client gives up."""
MAX_WAIT_APPLIED_HEADER = "X-Backfill-Max-Wait-Applied"
"""Set on the answer when the wait applied is shorter than the caller's ``X-Backfill-Max-Wait``
(clamped to the cap or to the client's timeout): the seconds it was."""
CLIENT_TIMEOUT_HEADER = "x-stainless-read-timeout"
NODE_HEADER = "X-Backfill-Node"
CLIENT_CLOSED_REQUEST = 499


class MetricEvents:
    """Admission as the gateway's metrics count it (:class:`AdmissionEvents`)."""

    def admitted(self, admission: Admission, *, bounded: bool) -> None:
        m.IN_FLIGHT.inc()
        m.ADMISSIONS.labels("bound" if bounded else "exact").inc()
        m.ADMISSION_WAIT.observe(admission.waited_s)
        m.RESERVED_TOKENS.observe(admission.lease.tokens)
        if admission.lease.preempted:
            m.BATCH_PREEMPTIONS.inc(len(admission.lease.preempted))

    def lease_ended(self, used_tokens: int | None) -> None:
        m.IN_FLIGHT.dec()
        if used_tokens is not None:
            m.USED_TOKENS.observe(used_tokens)

    def bound_violated(self) -> None:
        m.BOUND_VIOLATIONS.inc()


@dataclass
class Relay:
    """What a relayed stream has shown so far."""

    endpoint: str
    received: float
    first_token: float | None = None
    last_token: float | None = None
    completion: int = 0
    usage: Mapping[str, Any] | None = None
    error: bool = False
    done: bool = False
    pending: PendingInteractive | None = None
    """The request as the work budget's signals count it, until its first token."""
    headers_at: float | None = None
    """When the engine's response headers came (the hop account's stamp before the first
    event)."""
    events: int = 0
    """Events received from the engine so far."""

    def received_event(self, now: float) -> None:
        if self.events == 0 and self.headers_at is not None:
            m.HOP_ENGINE_FIRST_CHUNK.observe(now - self.headers_at)
        self.events += 1

    def handed_on(self, received: float, now: float) -> None:
        """An event received at ``received`` went to the client by ``now``."""
        hop = m.HOP_FIRST_CHUNK_OUT if self.events == 1 else m.HOP_CHUNK_OUT
        hop.observe(now - received)

    def leased(
        self, event: Mapping[str, Any], now: float, keeper: LeaseKeeper, include_usage: bool
    ) -> bool:
        """``event`` seen (:meth:`saw`) and counted on ``keeper``'s lease; whether the caller
        gets it (not the usage-only event it did not ask for: the lease asked for it)."""
        self.saw(event, now)
        keeper.generated = self.completion
        if self.completion:
            keeper.start_counting()
        return bool(event.get("choices")) or "usage" not in event or include_usage

    async def settle(self, keeper: LeaseKeeper, sizing: Sizing) -> None:
        """End ``keeper``'s lease on what the stream showed (its usage, else its tokens)."""
        keeper.generated = max(keeper.generated, self.completion)
        keeper.check_bound(sizing, self.usage)
        await keeper.end(used_tokens(keeper.exact or sizing, self.usage, self.completion))

    def saw(self, event: Mapping[str, Any], now: float) -> None:
        usage = event.get("usage")
        if isinstance(usage, Mapping):
            self.usage = usage
        if "error" in event:
            self.error = True
        tokens = 0
        for choice in event.get("choices") or ():
            if _carries_tokens(choice):
                tokens += 1
        if not tokens:
            return
        self.completion += tokens
        if self.first_token is None:
            self.first_token = now
            m.TIME_TO_FIRST_TOKEN.labels(self.endpoint).observe(now - self.received)
            if self.pending is not None:
                self.pending.first_token(now - self.received)
        elif self.last_token is not None:
            m.INTER_TOKEN_LATENCY.labels(self.endpoint).observe(now - self.last_token)
        self.last_token = now


def engine_payload(
    settings: Settings, body: Mapping[str, Any], admitted: Admitted, tenant_id: str
) -> dict[str, Any]:
    """The body an admitted request goes to the engine with: the interactive priority, the
    budget its lease covers, the tenant's ``cache_salt``."""
    payload = upstream_body(body, admitted.shape, admitted.sizing, settings.interactive_priority)
    if settings.tenant_cache_salt:
        payload["cache_salt"] = cache_salt(tenant_id)
    return payload


def _hops(request: Request, received: float, admitted: Admitted) -> None:
    """The hops of a request up to its lease: edge, parse, reserve (less the wait for room)."""
    accepted = request.scope.get("state", {}).get(ACCEPTED_STATE)
    if isinstance(accepted, float):
        m.HOP_EDGE.observe(received - accepted)
    m.HOP_PARSE.observe(admitted.counted_at - received)
    reserve = admitted.admitted_at - admitted.counted_at - admitted.waited_s
    m.HOP_RESERVE.observe(max(0.0, reserve))


def _carries_tokens(choice: Mapping[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is None:
        return bool(choice.get("text"))
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


def answer_headers(request: Request) -> dict[str, str]:
    """Headers the gateway adds to every answer of ``request`` (also its refusals)."""
    headers: dict[str, str] = getattr(request.state, "backfill_headers", {})
    return dict(headers)


def seconds_header(request: Request, name: str) -> float | None:
    raw = request.headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequest(f"header {name} must be a number of seconds", param=name) from None
    if not math.isfinite(value) or value < 0:
        raise InvalidRequest(f"header {name} must be a number of seconds >= 0", param=name)
    return value


async def _disconnected(request: Request) -> None:
    """Returns when the caller disconnects (the body is already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class _RelayResponse(StreamingResponse):
    """A stream whose lease is given back even when the relay never starts (the caller left
    before the first byte could be sent): the relay's own ``finally`` covers the rest."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        *,
        on_close: Callable[[], Awaitable[None]],
        media_type: str,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(content, media_type=media_type, headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


class InteractiveGateway:
    """One per API process: engines' HTTP clients and the core's interactive admission."""

    def __init__(
        self, settings: Settings, repo: Repository, *, host_clock: HostClock = time.time
    ) -> None:
        self.settings = settings
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._engines: dict[str, HttpEngine] = {}
        self.admission = InteractiveAdmission(
            settings, repo, self.engine, events=MetricEvents(), host_clock=host_clock
        )

    def client(self, url: str) -> httpx.AsyncClient:
        client = self._clients.get(url)
        if client is None:
            # No read timeout: a generation may take long; the caller's disconnect ends it.
            key = self.settings.engine_api_key
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(30.0, read=None),
                limits=engine_limits(1024, 256),
                # The engines' own key (vLLM's --api-key), never the caller's.
                headers={"Authorization": f"Bearer {key.get_secret_value()}"} if key else None,
            )
            self._clients[url] = client
        return client

    def engine(self, url: str) -> HttpEngine:
        engine = self._engines.get(url)
        if engine is None:
            engine = HttpEngine(url, client=self.client(url))
            self._engines[url] = engine
        return engine

    async def aclose(self) -> None:
        await self.admission.aclose()
        for client in self._clients.values():
            await client.aclose()

    # -----------------------------------------------------------------------------------------

    async def handle(
        self, endpoint: InteractiveEndpoint, request: Request, tenant: TenantRecord
    ) -> Response:
        received = time.perf_counter()
        try:
            return await self._handle(endpoint, request, tenant, received)
        except GatewayRefusal as exc:
            m.REJECTIONS.labels(exc.reason).inc()
            raise
        except InvalidRequest:
            m.REJECTIONS.labels("invalid_request").inc()
            raise
        except ClientGone:
            m.REJECTIONS.labels("client_gone").inc()
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _handle(
        self,
        endpoint: InteractiveEndpoint,
        request: Request,
        tenant: TenantRecord,
        received: float,
    ) -> Response:
        body = load_json_body(await request.body())
        parsed = await self.admission.parse(endpoint, body, (tenant.id, tenant.name))
        asked = seconds_header(request, MAX_WAIT_HEADER)
        budget = self.admission.wait_budget(asked, seconds_header(request, CLIENT_TIMEOUT_HEADER))
        if asked is not None and budget < asked:
            request.state.backfill_headers = {MAX_WAIT_APPLIED_HEADER: f"{budget:g}"}
        admitted = await self.admission.admit(
            parsed,
            owner=f"gateway/{tenant.id}",
            max_wait_s=budget,
            disconnected=request.is_disconnected,
        )
        shape = admitted.shape
        keeper, pending = admitted.keeper, admitted.pending
        try:
            payload = engine_payload(self.settings, parsed.body, admitted, tenant.id)
            overhead = (admitted.counted_at - received) + (
                time.perf_counter() - admitted.admitted_at
            )
            m.GATEWAY_OVERHEAD.labels(endpoint.value).observe(overhead)
            _hops(request, received, admitted)
            if shape.stream:
                return await self._stream(request, admitted, payload, received)
            try:
                return await self._unary(request, admitted, payload, received)
            finally:
                # No first token is visible without streaming: it stops counting when it ends.
                pending.end()
        except BaseException:
            pending.end()
            with anyio.CancelScope(shield=True):
                await keeper.end(None)
            raise

    async def _stream(
        self, request: Request, admitted: Admitted, payload: Mapping[str, Any], received: float
    ) -> Response:
        node, shape, sizing = admitted.node, admitted.shape, admitted.sizing
        keeper, pending = admitted.keeper, admitted.pending
        extra = answer_headers(request)  # Starlette cancels the relay when the caller leaves
        client = self.client(node.engine_url)
        upstream_request = client.build_request(
            "POST",
            f"{node.engine_url}{shape.endpoint.value}",
            json=payload,
            headers={"X-Request-Id": keeper.lease.lease_id, "Accept": "text/event-stream"},
        )
        sent = time.perf_counter()
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.TransportError as exc:
            raise GatewayUnavailable(
                f"the engine of node {node.name} is unreachable: {exc!r}", retry_after_s=1.0
            ) from exc
        headers_at = time.perf_counter()
        m.HOP_ENGINE_HEADERS.observe(headers_at - sent)
        if upstream.is_error:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            m.REQUESTS.labels(shape.endpoint.value, "engine_error").inc()
            await keeper.end(None)
            pending.end()
            return Response(
                content,
                upstream.status_code,
                media_type="application/json",
                headers=extra,
            )
        relay = Relay(shape.endpoint.value, received, pending=pending, headers_at=headers_at)
        return _RelayResponse(
            self._relay(upstream, shape, sizing, keeper, relay),
            on_close=partial(self._finish, upstream, sizing, keeper, relay),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", NODE_HEADER: node.name, **extra},
        )

    async def _relay(
        self,
        upstream: httpx.Response,
        shape: RequestShape,
        sizing: Sizing,
        keeper: LeaseKeeper,
        relay: Relay,
    ) -> AsyncIterator[bytes]:
        outcome = "disconnected"
        try:
            async for line in sse_lines(upstream):
                if not line.startswith("data:"):
                    continue
                line_at = time.perf_counter()
                relay.received_event(line_at)
                data = line[5:].strip()
                if data == "[DONE]":
                    # Read on to the end of the body (the engine ends it right after): a
                    # response closed early takes its connection with it, and the next
                    # request pays a new TCP connection to the engine.
                    relay.done = True
                    continue
                if relay.done:
                    continue
                try:
                    event = json.loads(data)
                except ValueError:
                    yield f"data: {data}\n\n".encode()
                    continue
                if not relay.leased(event, time.perf_counter(), keeper, shape.include_usage):
                    continue
                yield f"data: {data}\n\n".encode()
                relay.handed_on(line_at, time.perf_counter())
            outcome = "engine_error" if relay.error else "completed"
            if relay.done:
                # Give the room back before the caller sees the end of the stream.
                await self._finish(upstream, sizing, keeper, relay)
                yield b"data: [DONE]\n\n"
        except httpx.TransportError as exc:
            outcome = "engine_error"
            log.warning("interactive stream from %s broke: %r", keeper.lease.node, exc)
        finally:
            with anyio.CancelScope(shield=True):
                await self._finish(upstream, sizing, keeper, relay)
            m.REQUESTS.labels(shape.endpoint.value, outcome).inc()
            m.REQUEST_DURATION.labels(shape.endpoint.value, "true").observe(
                time.perf_counter() - relay.received
            )

    async def _finish(
        self, upstream: httpx.Response, sizing: Sizing, keeper: LeaseKeeper, relay: Relay
    ) -> None:
        # Closing first: an unfinished request is aborted in the engine before its room is
        # handed to anyone else.
        await upstream.aclose()
        if relay.pending is not None:
            relay.pending.end()
        await relay.settle(keeper, sizing)

    async def _unary(
        self, request: Request, admitted: Admitted, payload: Mapping[str, Any], received: float
    ) -> Response:
        node, shape, sizing = admitted.node, admitted.shape, admitted.sizing
        keeper = admitted.keeper
        client = self.client(node.engine_url)
        sent = time.perf_counter()
        call = asyncio.ensure_future(
            client.post(
                f"{node.engine_url}{shape.endpoint.value}",
                json=payload,
                headers={"X-Request-Id": keeper.lease.lease_id},
            )
        )
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not call.done():
                # Dropping the connection makes vLLM abort the request.
                call.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await call
        label = shape.endpoint.value
        if call.cancelled():
            m.REQUESTS.labels(label, "disconnected").inc()
            await keeper.end(None)
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        try:
            response = call.result()
        except httpx.TransportError as exc:
            m.REQUESTS.labels(label, "engine_error").inc()
            raise GatewayUnavailable(
                f"the engine of node {node.name} is unreachable: {exc!r}", retry_after_s=1.0
            ) from exc
        m.HOP_ENGINE_ANSWER.observe(time.perf_counter() - sent)
        usage: Mapping[str, Any] | None = None
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                usage = response.json().get("usage")
        keeper.generated = int((usage or {}).get("completion_tokens") or 0)
        keeper.check_bound(sizing, usage)
        await keeper.end(
            used_tokens(keeper.exact or sizing, usage, keeper.generated) if usage else None
        )
        outcome = "completed" if response.status_code == 200 else "engine_error"
        m.REQUESTS.labels(label, outcome).inc()
        m.REQUEST_DURATION.labels(label, "false").observe(time.perf_counter() - received)
        return Response(
            response.content,
            response.status_code,
            headers={NODE_HEADER: node.name, **answer_headers(request)},
            media_type="application/json",
        )
