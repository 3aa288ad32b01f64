"""One interactive request from its body to a lease on a node: find the serving nodes, check
the cheap bound, admit on a bound of the prompt where that is safe or count it exactly on an
engine, reserve (waiting within the caller's budget), and keep the lease.

It talks to engines through the engine protocol only (counting prompts, context lengths);
proxying the request is the HTTP side's (``queue_api/gateway.py``).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from backfill.clock import HostClock
from backfill.config import Settings
from backfill.content_parts import MEDIA_REFUSED, tenant_media_policy
from backfill.engine.local_tokenizer import LocalCounts
from backfill.engine.protocol import (
    Engine,
    EngineError,
    EngineRejected,
    count_prefill,
)
from backfill.gateway.leases import AdmissionEvents, LeaseBeats, LeaseKeeper, NoEvents
from backfill.gateway.nodes import NodeDirectory, ServingNode
from backfill.gateway.placement import Admission, admit, wait_budget_s
from backfill.gateway.refusals import GatewayRefusal, GatewayUnavailable, ModelNotServed
from backfill.gateway.request import (
    InteractiveEndpoint,
    RequestShape,
    parse_request,
    prompt_upper_bound,
)
from backfill.gateway.signals import SignalPublisher
from backfill.gateway.sizing import RequestCaps, Sizing, check_bound, check_sequences, size_request
from backfill.ledger import AsyncLedger
from backfill.maintenance import pool_policy
from backfill.policy import tenant_share_ppm
from backfill.prefill import PrefillPlan, PromptCount, prefill_plan
from backfill.refusals import InvalidRequest, Refusal
from backfill.store import NodeRecords
from backfill.work_signals import PendingInteractive

log = logging.getLogger("backfill.gateway")

OVERHEAD_CACHE_SIZE = 1024
"""Shapes (model, roles) whose template overhead the gateway keeps."""


@dataclass(frozen=True)
class InteractiveRequest:
    """A parsed request and the nodes that serve its model."""

    shape: RequestShape
    body: Mapping[str, Any]
    nodes: Sequence[ServingNode]


@dataclass(frozen=True)
class Admitted:
    """A request holding a lease on ``node``: the caller proxies it and ends ``keeper``."""

    shape: RequestShape
    sizing: Sizing
    node: ServingNode
    keeper: LeaseKeeper
    pending: PendingInteractive
    """The request as the work budget's signals count it, until its first token."""
    bounded: bool
    counted_at: float
    """``time.perf_counter()`` once the prompt's size was known (counted or bounded)."""
    admitted_at: float
    """``time.perf_counter()`` once the lease was held."""
    waited_s: float = 0.0
    """Of that, the time spent waiting for room (0 when the first try found it)."""


async def _engine_count(engine: Engine, model: str, prompt: str) -> int:
    return await engine.tokenize_prompt(prompt, model)


def _fitting(nodes: Sequence[ServingNode], sizing: Sizing) -> list[str]:
    # A node with a shorter context than the widest would refuse the request itself.
    need = sizing.sequence_tokens
    return [n.name for n in nodes if n.max_model_len is None or need <= n.max_model_len]


class InteractiveAdmission:
    """One per API process: the ledger, the node directory, the signals, the overheads."""

    def __init__(
        self,
        settings: Settings,
        repo: NodeRecords,
        engine_for: Callable[[str], Engine],
        *,
        events: AdmissionEvents | None = None,
        host_clock: HostClock = time.time,
        node: str | None = None,
    ) -> None:
        self.settings = settings
        self.local_counts = LocalCounts() if settings.local_token_counts else None
        """The engines' tokenizer files, for exact counts of plain prompts (checked)."""
        self.node = node
        """The one node this admission places on (an engine gate's own); None: any node
        serving the model."""
        self.policy = pool_policy(settings)
        self.ttl_ms = int(settings.lease_ttl_s * 1000)
        self.ledger = AsyncLedger.from_url(
            settings.redis_url, settings.redis_namespace, self.policy, self.ttl_ms
        )
        self._engine_for = engine_for
        self.events = events or NoEvents()
        self.beats = LeaseBeats(self.ledger, settings.heartbeat_interval_s, self.ttl_ms)
        self.directory = NodeDirectory(repo, settings.gateway_node_refresh_s, engine_for)
        self.signals = SignalPublisher(
            self.ledger,
            ttl_s=settings.work_signal_ttl_s,
            budget_interval_s=settings.work_budget_interval_s,
            host_clock=host_clock,
        )
        self.caps = RequestCaps(
            max_sequences=settings.gateway_max_sequences,
            max_request_tokens=settings.gateway_max_request_tokens,
            max_wait_s=settings.gateway_max_wait_cap_s,
        )
        self._overheads: dict[tuple[str, tuple[str, ...]], int | None] = {}
        self.tenant_share_ppm = tenant_share_ppm(settings.gateway_tenant_share)
        """What one owner's (tenant's) interactive leases may hold of a node, in millionths
        of its capacity; None: no bound."""

    async def aclose(self) -> None:
        await self.beats.aclose()
        await self.signals.aclose()
        await self.directory.aclose()
        await self.ledger.aclose()

    async def parse(
        self, endpoint: InteractiveEndpoint, body: Any, tenant: tuple[str, str] | None = None
    ) -> InteractiveRequest:
        """Parse ``body`` (a decoded JSON body) of ``tenant`` (its id and name: the media
        parts it may send) and find the nodes serving its model; refuses what is not a
        request, what no node serves and more sequences than the cap."""
        media = MEDIA_REFUSED if tenant is None else tenant_media_policy(self.settings, tenant)
        shape = parse_request(endpoint, body, media)
        check_sequences(shape, self.caps.max_sequences)
        nodes, any_node = await self.directory.serving(shape.model)
        if self.node is not None:
            nodes = [n for n in nodes if n.name == self.node]
            if not nodes and not await self.directory.registered(self.node):
                raise GatewayUnavailable(
                    f"node {self.node} is not registered yet (its worker registers it)",
                    retry_after_s=5.0,
                )
        if not nodes:
            if any_node:
                raise ModelNotServed(
                    f"The model `{shape.model}` does not exist or no node serves it.",
                    param="model",
                )
            raise GatewayUnavailable("no inference node is registered yet", retry_after_s=5.0)
        return InteractiveRequest(shape, body, nodes)

    def wait_budget(self, asked_s: float | None, client_read_timeout_s: float | None) -> float:
        """Seconds the request may wait for room (see :func:`wait_budget_s`)."""
        return wait_budget_s(
            asked_s, self.settings.gateway_max_wait_s, client_read_timeout_s, self.caps.max_wait_s
        )

    async def admit(
        self,
        request: InteractiveRequest,
        *,
        owner: str,
        max_wait_s: float,
        disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> Admitted:
        """Admit ``request`` on a bound of its prompt where that is safe and room is there at
        once, else on the engine's exact count, waiting up to ``max_wait_s``; the lease is
        kept (heartbeats) from then on, until the caller ends it. ``owner`` names the
        request's tenant (``gateway/{tenant_id}``): the leases of one owner on a node are
        held to the tenant share (``gateway_tenant_share``) together."""
        shape, body, nodes = request.shape, request.body, request.nodes
        limit = self._limit(nodes)
        cap = self.caps.max_request_tokens
        check_bound(shape, limit, self.settings.max_bytes_per_token, cap)
        await self.signals.start()
        lease_id = f"gw_{secrets.token_hex(10)}"
        counted = time.perf_counter()
        bounded = await self._admit_on_bound(shape, nodes, limit, lease_id, owner)
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
                max_wait_s=max_wait_s,
                disconnected=disconnected,
            )
        admitted = time.perf_counter()
        lease = admission.lease
        pending.admitted(lease.node)
        self.events.admitted(admission, bounded=bounded is not None)
        keeper = LeaseKeeper(lease, self.beats, self.events)
        try:
            node = next(n for n in nodes if n.name == lease.node)
            if lease.preempted:
                log.info(
                    "%s admitted on %s after preempting %s batch lease(s)",
                    shape.endpoint.value,
                    lease.node,
                    len(lease.preempted),
                )
            if bounded is not None:
                keeper.count_later(partial(self._settle_exact, keeper, shape, body, node, sizing))
        except BaseException:
            pending.end()
            await keeper.end(None)
            raise
        return Admitted(
            shape,
            sizing,
            node,
            keeper,
            pending,
            bounded is not None,
            counted,
            admitted,
            admission.waited_s if admission.attempts > 1 else 0.0,
        )

    async def _admit_on_bound(
        self,
        shape: RequestShape,
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
        pending = self.signals.activity.arrived(fitting)
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
                tenant_share_ppm=self.tenant_share_ppm,
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
            engine = self._engine_for(node.engine_url)
            found: int | None
            try:
                if key[0] == "chat":
                    # The body /v1/chat/completions renders: generation prompt as asked.
                    empty = {
                        "messages": [{"role": role, "content": ""} for role in key[2:]],
                        "add_generation_prompt": key[1] == "True",
                        "continue_final_message": False,
                    }
                    found = await engine.tokenize(empty, shape.model)
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
            self.events.bound_violated()
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

    async def _count_locally(
        self, plan: PrefillPlan, engine: Engine, node: ServingNode, model: str
    ) -> int | None:
        """The plan's longest prompt by the engine's own tokenizer file, where this process can
        read it and the plan is plain text prompts (a chat's template stays the engine's), so
        an exact count costs the engine's API server nothing (the counts are checked against
        the engine's: ``backfill.engine.local_tokenizer``); None: the engine counts."""
        if self.local_counts is None or not all(set(b) == {"prompt"} for b in plan.tokenize):
            return None
        local = await self.local_counts.counter(engine, node.engine_url, model)
        if local is None:
            return None
        ask = partial(_engine_count, engine, model)
        counted = [await local.acount(str(b["prompt"]), ask) for b in plan.tokenize]
        return PromptCount.of([*counted, *plan.known], plan.n).longest

    def _limit(self, nodes: Sequence[ServingNode]) -> int:
        # The widest context of any serving node: never refuse what one of them could take.
        limit = self.policy.interactive.max_sequence_tokens
        contexts = [n.max_model_len for n in nodes]
        if contexts and all(c is not None for c in contexts):
            limit = min(limit, max(c for c in contexts if c is not None))
        return limit

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
            engine = self._engine_for(node.engine_url)
            try:
                counted = await self._count_locally(plan, engine, node, shape.model)
                if counted is not None:
                    return counted
                return (await count_prefill(engine, plan, shape.model)).longest
            except EngineRejected as exc:
                raise InvalidRequest(exc.message, param=shape.prompt_param) from exc
            except EngineError as exc:
                last = exc
        raise GatewayUnavailable(
            f"no engine serving {shape.model} could count the prompt: {last}", retry_after_s=2.0
        )
