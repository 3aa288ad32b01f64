"""The interactive gateway's HTTP side: find the serving nodes, count the prompt on an engine,
admit through ``backfill.gateway``, proxy to the chosen node's vLLM server, and give the
reservation back exactly once however the request ends.

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
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from backfill.clock import HostClock, SharedClock, redis_time
from backfill.config import Settings
from backfill.errors import BackfillError
from backfill.gateway import (
    Admission,
    ClientGone,
    GatewayRefusal,
    GatewayUnavailable,
    InteractiveEndpoint,
    ModelNotServed,
    RequestCaps,
    RequestShape,
    Sizing,
    admit,
    check_bound,
    check_sequences,
    parse_request,
    prompt_upper_bound,
    size_request,
    upstream_body,
    wait_budget_s,
)
from backfill.ledger import AsyncLedger, Lease
from backfill.maintenance import pool_policy
from backfill.prefill import prefill_plan
from backfill.refusals import InvalidRequest, Refusal
from backfill.store import Repository, TenantRecord
from backfill.work_signals import InteractiveActivity, PendingInteractive, publish_signals
from queue_api import gateway_metrics as m
from queue_api.edge import load_json_body
from worker.engine import EngineError, EngineRejected, HttpEngine, count_prefill, sse_lines

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


@dataclass(frozen=True)
class ServingNode:
    name: str
    engine_url: str
    model: str
    max_model_len: int | None


class NodeDirectory:
    """Registered nodes (Postgres) with each engine's context length, refreshed in the
    background so no request waits on Postgres after the first."""

    def __init__(self, repo: Repository, refresh_s: float, engine_for: Any) -> None:
        self._repo = repo
        self._refresh_s = refresh_s
        self._engine_for = engine_for
        self._nodes: list[ServingNode] | None = None
        self._loaded_at = 0.0
        self._refreshing: asyncio.Task[None] | None = None
        self._context: dict[tuple[str, str], int | None] = {}

    async def serving(self, model: str) -> tuple[list[ServingNode], bool]:
        """Nodes serving ``model``, and whether any node is registered at all."""
        stale = time.monotonic() - self._loaded_at > self._refresh_s
        if self._nodes is None or (stale and not self._nodes):
            await self._refresh()
        elif stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self._refresh())
        nodes = self._nodes or []
        return [n for n in nodes if n.model == model], bool(nodes)

    async def _refresh(self) -> None:
        try:
            records = await asyncio.to_thread(self._repo.nodes)
        except BackfillError as exc:
            log.warning("node directory not refreshed: %s", exc)
            if self._nodes is None:
                raise GatewayUnavailable(
                    "the node directory is unavailable", retry_after_s=5.0
                ) from exc
            return
        nodes = []
        for r in records:
            if r.model is None:
                continue
            key = (r.engine_url, r.model)
            if self._context.get(key) is None:
                self._context[key] = await self._context_length(r.engine_url, r.model)
            nodes.append(ServingNode(r.name, r.engine_url, r.model, self._context[key]))
        self._nodes = nodes
        self._loaded_at = time.monotonic()

    async def _context_length(self, url: str, model: str) -> int | None:
        try:
            models = await self._engine_for(url).models()
        except EngineError:
            return None
        return next((x.max_model_len for x in models if x.id == model), None)

    async def aclose(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refreshing


class LeaseKeeper:
    """Heartbeats an admitted lease while its request runs, records progress, and settles and
    releases it exactly once."""

    def __init__(self, ledger: AsyncLedger, lease: Lease, interval_s: float, ttl_ms: int) -> None:
        self.ledger = ledger
        self.lease = lease
        self.generated = 0
        self._interval_s = interval_s
        self._ttl_ms = ttl_ms
        self._ended = False
        self._beat = asyncio.get_running_loop().create_task(self._heartbeat())
        self.exact: Sizing | None = None
        """The sizing on the engine's count, once known, of a request admitted on a bound."""
        self._count: Callable[[], Awaitable[None]] | None = None
        self._counting: asyncio.Task[None] | None = None

    def count_later(self, count: Callable[[], Awaitable[None]]) -> None:
        """Run ``count`` (the exact count of a bound admission) after the first token or the
        first heartbeat, whichever comes first: not beside the request's prefill, whose
        engine it would slow."""
        self._count = count

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def bounded(self) -> bool:
        """Admitted on a bound of its prompt, not the engine's count."""
        return self._count is not None

    def start_counting(self) -> None:
        if self._count is not None and self._counting is None and not self._ended:
            self._counting = asyncio.ensure_future(self._count())

    async def settle_reservation(self, tokens: int) -> None:
        """Shrink the reservation to ``tokens`` (the exact need of a bound admission)."""
        if self._ended:
            return
        lease = self.lease
        try:
            await self.ledger.settle(
                lease.node,
                lease.lease_id,
                lease.fencing_token,
                self.generated,
                reservation_tokens=tokens,
            )
        except BackfillError as exc:
            log.warning("interactive lease %s not settled: %s", lease.lease_id, exc)

    async def _heartbeat(self) -> None:
        lease = self.lease
        while True:
            await asyncio.sleep(self._interval_s)
            self.start_counting()
            try:
                beat = await self.ledger.heartbeat(
                    lease.node, lease.lease_id, lease.fencing_token, ttl_ms=self._ttl_ms
                )
                if not beat.ok:
                    log.warning("interactive lease %s: heartbeat %s", lease.lease_id, beat.status)
                    return
                await self.ledger.settle(
                    lease.node, lease.lease_id, lease.fencing_token, self.generated
                )
            except BackfillError as exc:
                log.warning("interactive lease %s: heartbeat failed: %s", lease.lease_id, exc)

    async def end(self, used_tokens: int | None) -> None:
        """Settle with the tokens used (when known) and release; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        self._beat.cancel()
        lease = self.lease
        m.IN_FLIGHT.dec()
        try:
            if used_tokens is not None:
                m.USED_TOKENS.observe(used_tokens)
                await self.ledger.settle(
                    lease.node,
                    lease.lease_id,
                    lease.fencing_token,
                    self.generated,
                    reservation_tokens=max(1, used_tokens),
                )
            await self.ledger.release(lease)
        except BackfillError as exc:
            # The lease expires on its own within the TTL.
            log.warning("interactive lease %s not released: %s", lease.lease_id, exc)


@dataclass
class _Relay:
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


def _carries_tokens(choice: Mapping[str, Any]) -> bool:
    delta = choice.get("delta")
    if delta is None:
        return bool(choice.get("text"))
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))


OVERHEAD_CACHE_SIZE = 1024
"""Shapes (model, roles) whose template overhead the gateway keeps."""


def _fitting(nodes: Sequence[ServingNode], sizing: Sizing) -> list[str]:
    # A node with a shorter context than the widest would refuse the request itself.
    need = sizing.sequence_tokens
    return [n.name for n in nodes if n.max_model_len is None or need <= n.max_model_len]


def _check_bound(keeper: LeaseKeeper, sizing: Sizing, usage: Mapping[str, Any] | None) -> None:
    """A bound admission whose single prompt the engine's usage counts above the bound."""
    if keeper.ended or not keeper.bounded or usage is None or sizing.sequences != 1:
        return
    prompt = usage.get("prompt_tokens")
    if isinstance(prompt, int) and prompt > sizing.prompt_tokens and keeper.exact is None:
        m.BOUND_VIOLATIONS.inc()
        log.error(
            "interactive lease %s: the prompt had %s tokens, over its bound of %s",
            keeper.lease.lease_id,
            prompt,
            sizing.prompt_tokens,
        )


def _used_tokens(sizing: Sizing, usage: Mapping[str, Any] | None, completion: int) -> int:
    """KV tokens the request held at its largest, per the engine's usage when it sent one."""
    prompt = sizing.prompt_tokens
    if usage is not None:
        completion = int(usage.get("completion_tokens") or completion)
    return sizing.sequences * prompt + completion


def answer_headers(request: Request) -> dict[str, str]:
    """Headers the gateway adds to every answer of ``request`` (also its refusals)."""
    headers: dict[str, str] = getattr(request.state, "backfill_headers", {})
    return dict(headers)


def _float_header(request: Request, name: str) -> float | None:
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
    """One per API process: engines' HTTP clients, the ledger, the node directory."""

    def __init__(
        self, settings: Settings, repo: Repository, *, host_clock: HostClock = time.time
    ) -> None:
        self.settings = settings
        self.policy = pool_policy(settings)
        self.ttl_ms = int(settings.lease_ttl_s * 1000)
        self.ledger = AsyncLedger.from_url(
            settings.redis_url, settings.redis_namespace, self.policy, self.ttl_ms
        )
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._engines: dict[str, HttpEngine] = {}
        self.directory = NodeDirectory(repo, settings.gateway_node_refresh_s, self.engine)
        # What this process sees of interactive traffic per node, published for the workers'
        # work budgets (``backfill.work_signals``).
        # Its stamps are on Redis' clock: the workers that read them run on other hosts, whose
        # clocks may disagree with this one (``host_clock``).
        self.clock = SharedClock(host=host_clock)
        self.activity = InteractiveActivity(clock=self.clock.now)
        self.gateway_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._publisher: asyncio.Task[None] | None = None
        self.caps = RequestCaps(
            max_sequences=settings.gateway_max_sequences,
            max_request_tokens=settings.gateway_max_request_tokens,
            max_wait_s=settings.gateway_max_wait_cap_s,
        )
        self._overheads: dict[tuple[str, tuple[str, ...]], int | None] = {}

    def client(self, url: str) -> httpx.AsyncClient:
        client = self._clients.get(url)
        if client is None:
            # No read timeout: a generation may take long; the caller's disconnect ends it.
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(30.0, read=None),
                limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
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
        if self._publisher is not None:
            self._publisher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._publisher
        await self.directory.aclose()
        for client in self._clients.values():
            await client.aclose()
        await self.ledger.aclose()

    async def _publish_signals(self) -> None:
        """Publish the interactive activity soon after it changes, and often enough to stay
        fresh within the signals' TTL while it does not."""
        ttl = self.settings.work_signal_ttl_s
        interval = min(0.1, self.settings.work_budget_interval_s / 2)
        version, published_at = -1, 0.0
        while True:
            await asyncio.sleep(interval)
            try:
                now = await self.clock.refresh(redis_time(self.ledger.client))
            except Exception as exc:  # go on from the last anchor
                log.debug("Redis' clock not read: %s", exc)
                now = self.clock.now()
            if self.activity.version == version and now - published_at < ttl / 3:
                continue
            version = self.activity.version
            try:
                await publish_signals(
                    self.ledger.client,
                    self.ledger.keys,
                    self.gateway_id,
                    self.activity.snapshot(keep_s=ttl),
                    ttl,
                    now,
                )
                published_at = now
            except Exception as exc:  # batch then judges by the engine's queue alone
                log.warning("interactive signals not published: %s", exc)

    async def _start_publisher(self) -> None:
        """Publish from now on; the first time, anchor the clock the stamps are written on
        (one round trip to Redis, once per process)."""
        if not self.clock.anchored:
            try:
                await self.clock.sync(redis_time(self.ledger.client))
            except Exception as exc:  # the publisher tries again
                log.warning("Redis' clock not read: %s", exc)
        if self._publisher is None or self._publisher.done():
            self._publisher = asyncio.get_running_loop().create_task(self._publish_signals())

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
        shape = parse_request(endpoint, body)
        check_sequences(shape, self.caps.max_sequences)
        nodes, any_node = await self.directory.serving(shape.model)
        if not nodes:
            if any_node:
                raise ModelNotServed(
                    f"The model `{shape.model}` does not exist or no node serves it.",
                    param="model",
                )
            raise GatewayUnavailable("no inference node is registered yet", retry_after_s=5.0)
        asked = _float_header(request, MAX_WAIT_HEADER)
        budget = wait_budget_s(
            asked,
            self.settings.gateway_max_wait_s,
            _float_header(request, CLIENT_TIMEOUT_HEADER),
            self.caps.max_wait_s,
        )
        if asked is not None and budget < asked:
            request.state.backfill_headers = {MAX_WAIT_APPLIED_HEADER: f"{budget:g}"}
        limit = self._limit(nodes)
        cap = self.caps.max_request_tokens
        check_bound(shape, limit, self.settings.max_bytes_per_token, cap)
        await self._start_publisher()
        lease_id = f"gw_{secrets.token_hex(10)}"
        owner = f"gateway/{tenant.id}"
        counted = time.perf_counter()
        bounded = await self._admit_on_bound(shape, body, nodes, limit, lease_id, owner)
        if bounded is not None:
            admission, sizing, pending = bounded
        else:
            prompt_tokens = await self._count(shape, body, nodes)
            sizing = size_request(shape, prompt_tokens, limit, cap)
            counted = time.perf_counter()
            admission, pending = await self._reserve(
                nodes,
                sizing,
                lease_id,
                owner,
                max_wait_s=budget,
                disconnected=request.is_disconnected,
            )
        admitted = time.perf_counter()
        lease = admission.lease
        pending.admitted(lease.node)
        m.IN_FLIGHT.inc()
        m.ADMISSIONS.labels("bound" if bounded is not None else "exact").inc()
        keeper = LeaseKeeper(self.ledger, lease, self.settings.heartbeat_interval_s, self.ttl_ms)
        try:
            node = next(n for n in nodes if n.name == lease.node)
            self._record_admission(admission, endpoint)
            if bounded is not None:
                keeper.count_later(partial(self._settle_exact, keeper, shape, body, node, sizing))
            payload = upstream_body(body, shape, sizing, self.settings.interactive_priority)
            overhead = (counted - received) + (time.perf_counter() - admitted)
            m.GATEWAY_OVERHEAD.labels(endpoint.value).observe(overhead)
            if shape.stream:
                return await self._stream(
                    request, node, shape, sizing, payload, keeper, received, pending
                )
            try:
                return await self._unary(request, node, shape, sizing, payload, keeper, received)
            finally:
                # No first token is visible without streaming: it stops counting when it ends.
                pending.end()
        except BaseException:
            pending.end()
            with anyio.CancelScope(shield=True):
                await keeper.end(None)
            raise

    async def _admit_on_bound(
        self,
        shape: RequestShape,
        body: Mapping[str, Any],
        nodes: Sequence[ServingNode],
        limit: int,
        lease_id: str,
        owner: str,
    ) -> tuple[Admission, Sizing, PendingInteractive] | None:
        """Admit on an upper bound of the prompt's tokens, without tokenizing, where that is
        safe and a node has the room now without preempting or waiting; None: count exactly.

        Only a request with an explicit output budget qualifies (an absent one is the rest of
        the context, which needs the exact count), and only when the bound leaves it within
        the class limit (near the limit, only the exact count can tell)."""
        key = shape.bound_key
        given = shape.max_output_tokens
        if not self.settings.gateway_bound_admission or key is None or given is None:
            return None
        if (shape.model, key) in self._overheads:
            overhead = self._overheads[(shape.model, key)]
        else:
            overhead = await self._measure_overhead(shape, key, nodes)
        if overhead is None:
            return None
        bound = prompt_upper_bound(shape, overhead)
        if bound + given > limit:
            return None
        if shape.sequences * (bound + given) > self.caps.max_request_tokens:
            return None  # the exact count may bring it under the cap
        sizing = size_request(shape, bound, limit)
        try:
            admission, pending = await self._reserve(
                nodes, sizing, lease_id, owner, max_wait_s=0.0, allow_preemption=False
            )
        except GatewayRefusal:
            return None
        return admission, sizing, pending

    async def _reserve(
        self,
        nodes: Sequence[ServingNode],
        sizing: Sizing,
        lease_id: str,
        owner: str,
        *,
        max_wait_s: float,
        allow_preemption: bool = True,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> tuple[Admission, PendingInteractive]:
        """Reserve ``sizing`` on a node whose context can hold it; the request counts as
        pending interactive work (the work budget's signal) from now on."""
        fitting = _fitting(nodes, sizing)
        pending = self.activity.arrived(fitting)
        try:
            admission = await admit(
                self.ledger,
                fitting,
                sizing,
                lease_id=lease_id,
                owner=owner,
                ttl_ms=self.ttl_ms,
                max_wait_s=max_wait_s,
                allow_preemption=allow_preemption,
                disconnected=disconnected,
            )
        except BaseException:
            pending.end()
            raise
        return admission, pending

    async def _measure_overhead(
        self, shape: RequestShape, key: tuple[str, ...], nodes: Sequence[ServingNode]
    ) -> int | None:
        """Tokens the tokenizer or chat template adds around the text of requests of this
        shape: the engine's count of the same shape with empty text (kept per model)."""
        for node in nodes:
            engine = self.engine(node.engine_url)
            found: int | None
            try:
                if key[0] == "chat":
                    found = await engine.tokenize_chat(
                        [{"role": role, "content": ""} for role in key[2:]],
                        shape.model,
                        add_generation_prompt=key[1] == "True",
                    )
                else:
                    found = await engine.tokenize_prompt("", shape.model)
            except EngineRejected as exc:
                # This shape cannot be rendered empty (a template that insists on content,
                # say): its requests are counted exactly from now on.
                log.info("no prompt bound for %s %s: %s", shape.model, key, exc.message)
                found = None
            except EngineError:
                continue
            if len(self._overheads) >= OVERHEAD_CACHE_SIZE:
                self._overheads.clear()
            self._overheads[(shape.model, key)] = found
            return found
        return None

    async def _settle_exact(
        self,
        keeper: LeaseKeeper,
        shape: RequestShape,
        body: Mapping[str, Any],
        node: ServingNode,
        bound: Sizing,
    ) -> None:
        """Off the request's path: count the prompt of a bound admission exactly, shrink its
        reservation to that, and check the bound held."""
        try:
            tokens = await self._count(shape, body, [node])
        except Refusal as exc:
            log.info("interactive lease %s: no exact count: %s", keeper.lease.lease_id, exc)
            return
        if tokens > bound.prompt_tokens:
            m.BOUND_VIOLATIONS.inc()
            log.error(
                "interactive lease %s: the prompt has %s tokens, over its bound of %s "
                "(model %s): it ran on a reservation short of its need; turn bound "
                "admission off (BACKFILL_GATEWAY_BOUND_ADMISSION=false) for this model",
                keeper.lease.lease_id,
                tokens,
                bound.prompt_tokens,
                shape.model,
            )
        exact = Sizing(tokens, bound.max_output_tokens, bound.sequences, bound.output_defaulted)
        keeper.exact = exact
        await keeper.settle_reservation(exact.sequences * exact.sequence_tokens)

    def _limit(self, nodes: Sequence[ServingNode]) -> int:
        # The widest context of any serving node: never refuse what one of them could take.
        limit = self.policy.interactive.max_sequence_tokens
        contexts = [n.max_model_len for n in nodes]
        if contexts and all(c is not None for c in contexts):
            limit = min(limit, max(c for c in contexts if c is not None))
        return limit

    def _record_admission(self, admission: Admission, endpoint: InteractiveEndpoint) -> None:
        m.ADMISSION_WAIT.observe(admission.waited_s)
        m.RESERVED_TOKENS.observe(admission.lease.tokens)
        if admission.lease.preempted:
            m.BATCH_PREEMPTIONS.inc(len(admission.lease.preempted))
            log.info(
                "%s admitted on %s after preempting %s batch lease(s)",
                endpoint.value,
                admission.lease.node,
                len(admission.lease.preempted),
            )

    async def _count(
        self, shape: RequestShape, body: Mapping[str, Any], nodes: Sequence[ServingNode]
    ) -> int:
        """Exact prompt tokens of the longest prompt (each of a request's sequences is
        charged that many), from the first serving engine that answers."""
        # The same plan the worker counts batch items by: every field that renders into the
        # prompt is counted (tools, documents, template arguments), each prompt of a list.
        plan = prefill_plan(shape.endpoint.value, body)
        if not plan.tokenize:
            return max(plan.known)
        last: Exception | None = None
        for node in nodes:
            engine = self.engine(node.engine_url)
            try:
                return (await count_prefill(engine, plan, shape.model)).longest
            except EngineRejected as exc:
                raise InvalidRequest(exc.message, param=shape.prompt_param) from exc
            except EngineError as exc:
                last = exc
        raise GatewayUnavailable(
            f"no engine serving {shape.model} could count the prompt: {last}", retry_after_s=2.0
        )

    async def _stream(
        self,
        request: Request,
        node: ServingNode,
        shape: RequestShape,
        sizing: Sizing,
        payload: Mapping[str, Any],
        keeper: LeaseKeeper,
        received: float,
        pending: PendingInteractive | None = None,
    ) -> Response:
        extra = answer_headers(request)  # Starlette cancels the relay when the caller leaves
        client = self.client(node.engine_url)
        upstream_request = client.build_request(
            "POST",
            f"{node.engine_url}{shape.endpoint.value}",
            json=payload,
            headers={"X-Request-Id": keeper.lease.lease_id, "Accept": "text/event-stream"},
        )
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.TransportError as exc:
            raise GatewayUnavailable(
                f"the engine of node {node.name} is unreachable: {exc!r}", retry_after_s=1.0
            ) from exc
        if upstream.is_error:
            try:
                content = await upstream.aread()
            finally:
                await upstream.aclose()
            m.REQUESTS.labels(shape.endpoint.value, "engine_error").inc()
            await keeper.end(None)
            if pending is not None:
                pending.end()
            return Response(
                content,
                upstream.status_code,
                media_type="application/json",
                headers=extra,
            )
        relay = _Relay(shape.endpoint.value, received, pending=pending)
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
        relay: _Relay,
    ) -> AsyncIterator[bytes]:
        outcome = "disconnected"
        try:
            async for line in sse_lines(upstream):
                if not line.startswith("data:"):
                    continue
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
                relay.saw(event, time.perf_counter())
                keeper.generated = relay.completion
                if relay.completion:
                    keeper.start_counting()
                if not event.get("choices") and "usage" in event and not shape.include_usage:
                    continue
                yield f"data: {data}\n\n".encode()
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
        self, upstream: httpx.Response, sizing: Sizing, keeper: LeaseKeeper, relay: _Relay
    ) -> None:
        # Closing first: an unfinished request is aborted in the engine before its room is
        # handed to anyone else.
        await upstream.aclose()
        if relay.pending is not None:
            relay.pending.end()
        keeper.generated = max(keeper.generated, relay.completion)
        _check_bound(keeper, sizing, relay.usage)
        await keeper.end(_used_tokens(keeper.exact or sizing, relay.usage, relay.completion))

    async def _unary(
        self,
        request: Request,
        node: ServingNode,
        shape: RequestShape,
        sizing: Sizing,
        payload: Mapping[str, Any],
        keeper: LeaseKeeper,
        received: float,
    ) -> Response:
        client = self.client(node.engine_url)
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
        usage: Mapping[str, Any] | None = None
        if response.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                usage = response.json().get("usage")
        keeper.generated = int((usage or {}).get("completion_tokens") or 0)
        _check_bound(keeper, sizing, usage)
        await keeper.end(
            _used_tokens(keeper.exact or sizing, usage, keeper.generated) if usage else None
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
