"""The interactive admission gateway's decisions: request shape, size checks, routing, and the
admission loop over the ledger, as values and pure functions; :mod:`backfill.gateway.admission`
carries them out, and the HTTP side (``queue_api/gateway.py``) proxies and decides nothing.

The invariant applied to one interactive request, in this order:

1. **Cheap bound, before tokenizing.** A token covers at most ``max_bytes_per_token`` bytes
   of text, so ``ceil(prompt_bytes / max_bytes_per_token)`` is a lower bound on the prompt's
   tokens (the chat template only adds). Over the class limit even at that bound: refuse at
   once. Anything that might fit goes on to be counted.
2. **Exact count**, with the engine's own tokenizer: ``prompt + max_output`` over the limit is
   refused before any reservation or engine work.
3. **Reserve** ``prompt + max_output`` (block-rounded, per sequence) from the interactive pool,
   letting the ledger preempt batch leases when the node is short. No room on any node: wait
   within the caller's budget, polling, then refuse with a retry hint.

One request's reach is capped (:class:`RequestCaps`): its sequences (``n`` x prompts), the
tokens it reserves over all of them, checked with the limits above (on the bound, then
exactly), and how long it may wait. Without the caps a single request with a large
``n x max_tokens`` preempts every batch lease on a node, and one that waits for long holds
batch back all that while (a waiting request is pressure on the work budget).

A request without ``max_tokens`` may generate up to the model's context: its worst case is
``limit - prompt``, and the gateway sends that figure as ``max_tokens`` so the engine cannot
outgrow the reservation. (``/v1/completions`` defaults to 16, as vLLM and OpenAI do.)
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from backfill.errors import BackfillError, LedgerError, LedgerUnavailable
from backfill.ledger import AsyncLedger, Denial, Lease, PoolSnapshot
from backfill.policy import Reason, ServiceClass
from backfill.prefill import prefill_plan
from backfill.refusals import InvalidRequest, Refusal

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""What vLLM and OpenAI generate for a ``/v1/completions`` request without ``max_tokens``."""


class InteractiveEndpoint(StrEnum):
    """The endpoints the gateway serves."""

    CHAT_COMPLETIONS = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"


# ---------------------------------------------------------------------------------------------
# Refusals: the API edge maps each class to a status; the core knows none.


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


class GatewayUnavailable(GatewayRefusal):
    """The gateway cannot admit now for reasons other than load: the ledger is down or being
    rebuilt, or no serving engine answers."""

    default_code = "service_unavailable"
    reason = "unavailable"


class ClientGone(BackfillError):
    """The caller disconnected while its request waited for room."""


# ---------------------------------------------------------------------------------------------
# The request's shape


@dataclass(frozen=True)
class RequestShape:
    """What admission needs from a chat or completions body."""

    endpoint: InteractiveEndpoint
    model: str
    stream: bool
    include_usage: bool
    """The caller asked for the final usage chunk (``stream_options.include_usage``)."""
    longest_prompt_bytes: int
    """UTF-8 bytes of the (longest) prompt's text: the cheap bound's input."""
    token_id_prompt_tokens: int | None
    """Exact tokens when the prompt is given as token ids (no tokenizing needed)."""
    text_prompts: tuple[str, ...]
    """Completions prompts given as text (each counted separately); empty for chat."""
    prompts: int
    n: int
    """Sequences per prompt (``max(n, best_of)``)."""
    max_output_tokens: int | None
    """As the caller gave it; None when absent."""
    budget_key: str
    """The body field that carries the output budget."""
    bound_key: tuple[str, ...] | None = None
    """What the tokens around the prompt's text depend on (see :func:`bound_key`); None when
    only an exact count is safe."""
    segments: int = 1
    """Pieces of text in the (longest) prompt: one per chat message, one for a prompt."""

    @property
    def sequences(self) -> int:
        return self.prompts * self.n

    @property
    def prompt_param(self) -> str:
        return "messages" if self.endpoint is InteractiveEndpoint.CHAT_COMPLETIONS else "prompt"


def _positive_int(body: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidRequest(f"{key} must be a positive integer", param=key)
    return value


def _content_bytes(content: object) -> int:
    if isinstance(content, str):
        return len(content.encode())
    if isinstance(content, list):
        total = 0
        for part in content:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                total += len(part["text"].encode())
        return total
    return 0


def _is_token_ids(value: object) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def parse_request(endpoint: InteractiveEndpoint, body: object) -> RequestShape:
    """The shape of a chat or completions request; raises :class:`InvalidRequest`."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", param="model")
    stream = body.get("stream") is True
    options = body.get("stream_options")
    include_usage = bool(stream and isinstance(options, Mapping) and options.get("include_usage"))
    n = max(_positive_int(body, "n", 1) or 1, _positive_int(body, "best_of", 1) or 1)
    text_prompts: tuple[str, ...] = ()
    ids: int | None = None
    if endpoint is InteractiveEndpoint.CHAT_COMPLETIONS:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages must be a non-empty array", param="messages")
        if not all(isinstance(m, Mapping) for m in messages):
            raise InvalidRequest("each message must be an object", param="messages")
        longest = sum(_content_bytes(m.get("content")) for m in messages)
        prompts = 1
        key = "max_tokens"
        if body.get("max_completion_tokens") is not None:
            key = "max_completion_tokens"
    else:
        prompt = body.get("prompt")
        prompts = 1
        if isinstance(prompt, str):
            text_prompts = (prompt,)
        elif _is_token_ids(prompt) and prompt:
            ids = len(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            text_prompts = tuple(prompt)
            prompts = len(prompt)
        elif isinstance(prompt, list) and prompt and all(_is_token_ids(p) and p for p in prompt):
            ids = max(len(p) for p in prompt)
            prompts = len(prompt)
        else:
            raise InvalidRequest(
                "prompt must be a string, an array of strings, or token ids", param="prompt"
            )
        longest = max((len(p.encode()) for p in text_prompts), default=0)
        key = "max_tokens"
    max_output = _positive_int(body, key, None)
    # Refuses what no count could cover (prompt embeddings) before any reservation.
    prefill_plan(endpoint.value, body)
    segments = len(body["messages"]) if endpoint is InteractiveEndpoint.CHAT_COMPLETIONS else 1
    return RequestShape(
        endpoint=endpoint,
        model=model,
        stream=stream,
        include_usage=include_usage,
        longest_prompt_bytes=longest,
        token_id_prompt_tokens=ids,
        text_prompts=text_prompts,
        prompts=prompts,
        n=n,
        max_output_tokens=max_output,
        budget_key=key,
        bound_key=bound_key(endpoint, body) if ids is None else None,
        segments=segments,
    )


# Request fields that change what is rendered around the text: a request with any of them is
# counted exactly. Messages with more than a role and plain-text content are too.
_CHAT_RENDERING_FIELDS = (
    "tools",
    "functions",
    "documents",
    "chat_template",
    "chat_template_kwargs",
    "continue_final_message",
    "add_special_tokens",
    "mm_processor_kwargs",
    "media_io_kwargs",
    "reasoning_effort",
)
_COMPLETIONS_RENDERING_FIELDS = ("suffix",)


def bound_key(endpoint: InteractiveEndpoint, body: Mapping[str, Any]) -> tuple[str, ...] | None:
    """What the tokens a tokenizer or chat template adds around a prompt's text depend on:
    ``("prompt",)`` for a completions prompt (the tokenizer's special tokens), ``("chat",
    add_generation_prompt, role, role, ...)`` for chat messages of plain text. None when a
    field could render more than that (tools, documents, template arguments, a custom
    template, content parts, named or tool messages): such requests are counted exactly."""
    if endpoint is InteractiveEndpoint.COMPLETIONS:
        if any(body.get(f) for f in _COMPLETIONS_RENDERING_FIELDS):
            return None
        return ("prompt",)
    if any(body.get(f) for f in _CHAT_RENDERING_FIELDS):
        return None
    generation = body.get("add_generation_prompt", True)
    if not isinstance(generation, bool):
        return None
    roles: list[str] = []
    for message in body["messages"]:
        role, content = message.get("role"), message.get("content")
        if set(message) - {"role", "content"} or not isinstance(role, str):
            return None
        if not isinstance(content, str):
            return None
        roles.append(role)
    return ("chat", str(generation), *roles)


BOUND_MARGIN_PER_SEGMENT = 2
"""Tokens allowed per piece of text beyond one per UTF-8 byte: a SentencePiece tokenizer may
split off a word-start marker, and text meeting template text may tokenize apart."""


def prompt_upper_bound(shape: RequestShape, overhead_tokens: int) -> int:
    """Tokens the (longest) prompt has at most, without tokenizing it: one per UTF-8 byte of
    its text (no token of a byte-level or byte-fallback vocabulary is shorter, special tokens
    aside, and those only shorten), plus what the tokenizer or chat template adds around the
    text (``overhead_tokens``, measured once on the same shape with empty text), plus a
    margin per piece of text."""
    return shape.longest_prompt_bytes + overhead_tokens + BOUND_MARGIN_PER_SEGMENT * shape.segments


# ---------------------------------------------------------------------------------------------
# Size checks


def prompt_lower_bound(shape: RequestShape, max_bytes_per_token: int) -> int:
    """Tokens the (longest) prompt has at least: exact for token ids, else bytes divided by
    the longest token's bytes, rounded up."""
    if shape.token_id_prompt_tokens is not None:
        return shape.token_id_prompt_tokens
    return math.ceil(shape.longest_prompt_bytes / max_bytes_per_token)


def check_bound(
    shape: RequestShape,
    limit: int,
    max_bytes_per_token: int,
    max_request_tokens: int | None = None,
) -> None:
    """Refuse, before tokenizing, what cannot fit ``limit`` (per sequence) or
    ``max_request_tokens`` (over all sequences) even at the prompt's lower bound."""
    lower = prompt_lower_bound(shape, max_bytes_per_token)
    least_output = shape.max_output_tokens or 1
    if (
        max_request_tokens is not None
        and shape.sequences * (lower + least_output) > max_request_tokens
    ):
        raise _over_token_cap(shape, lower, least_output, max_request_tokens, exact=False)
    if lower + least_output > limit:
        what = (
            f"prompt (at least {lower} tokens) + {shape.budget_key} ({least_output})"
            if shape.max_output_tokens
            else f"prompt (at least {lower} tokens)"
        )
        raise ContextLengthExceeded(
            f"This model's maximum context length for interactive requests is {limit} tokens; "
            f"the {what} cannot fit. Shorten the prompt or lower {shape.budget_key}.",
            stage="bound",
            limit=limit,
            param=shape.prompt_param if lower >= limit else shape.budget_key,
        )


@dataclass(frozen=True)
class RequestCaps:
    """What one interactive request may ask for (``BACKFILL_GATEWAY_MAX_SEQUENCES``,
    ``BACKFILL_GATEWAY_MAX_REQUEST_TOKENS``, ``BACKFILL_GATEWAY_MAX_WAIT_CAP_S``)."""

    max_sequences: int
    max_request_tokens: int
    """KV tokens over all of a request's sequences (``sequences x (prompt + max_output)``,
    before block rounding)."""
    max_wait_s: float


def _sequences_param(shape: RequestShape) -> str:
    return "n" if shape.n > 1 else shape.prompt_param


def check_sequences(shape: RequestShape, max_sequences: int) -> None:
    """Refuse, before anything is counted, a request of more sequences than the cap."""
    if shape.sequences <= max_sequences:
        return
    what = f"{shape.prompts} prompts x n={shape.n}" if shape.prompts > 1 else f"n={shape.n}"
    raise OverRequestCap(
        f"This request asks for {shape.sequences} sequences ({what}); an interactive request "
        f"may run at most {max_sequences}. Lower n (or send fewer prompts), or submit the "
        "work as a batch.",
        param=_sequences_param(shape),
        limit=max_sequences,
    )


def _over_token_cap(
    shape: RequestShape, prompt_tokens: int, output: int, cap: int, *, exact: bool
) -> OverRequestCap:
    total = shape.sequences * (prompt_tokens + output)
    prompt = f"{prompt_tokens} prompt" if exact else f"at least {prompt_tokens} prompt"
    # The output budget when lowering it could bring the request under the cap; else the
    # sequences (or the prompt itself).
    param = shape.budget_key if shape.sequences * prompt_tokens < cap else _sequences_param(shape)
    return OverRequestCap(
        f"This request would reserve {total} KV tokens ({shape.sequences} sequence(s) x "
        f"({prompt} + {output} {shape.budget_key})); an interactive request may reserve at "
        f"most {cap}. Lower {shape.budget_key} or n, or submit the work as a batch.",
        param=param,
        limit=cap,
    )


@dataclass(frozen=True)
class Sizing:
    """The reservation one request needs (per sequence; ``sequences`` of them)."""

    prompt_tokens: int
    max_output_tokens: int
    sequences: int
    output_defaulted: bool
    """The caller gave no budget: ``max_output_tokens`` must be sent to the engine."""

    @property
    def sequence_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


def size_request(
    shape: RequestShape, prompt_tokens: int, limit: int, max_request_tokens: int | None = None
) -> Sizing:
    """The exact check: ``prompt + max_output <= limit``, with the worst case for an absent
    budget (everything the context leaves, and the request cap allows; 16 for completions),
    and ``sequences x (prompt + max_output) <= max_request_tokens``."""
    given = shape.max_output_tokens
    if given is None and shape.endpoint is InteractiveEndpoint.COMPLETIONS:
        given = COMPLETIONS_DEFAULT_MAX_TOKENS
    output = given if given is not None else limit - prompt_tokens
    if given is None and max_request_tokens is not None:
        # No budget asked for: as much as the cap leaves each sequence (sent to the engine).
        output = min(output, max_request_tokens // shape.sequences - prompt_tokens)
        if output < 1 and prompt_tokens < limit:
            raise _over_token_cap(shape, prompt_tokens, 1, max_request_tokens, exact=True)
    if output < 1 or prompt_tokens + output > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length for interactive requests is {limit} tokens; "
            f"the prompt has {prompt_tokens} tokens"
            + (f" and {shape.budget_key} is {given}" if given is not None else "")
            + f". Shorten the prompt or lower {shape.budget_key}.",
            stage="exact",
            limit=limit,
            param=shape.prompt_param if prompt_tokens >= limit else shape.budget_key,
        )
    if max_request_tokens is not None and shape.sequences * (prompt_tokens + output) > (
        max_request_tokens
    ):
        raise _over_token_cap(shape, prompt_tokens, output, max_request_tokens, exact=True)
    return Sizing(prompt_tokens, output, shape.sequences, shape.max_output_tokens is None)


def upstream_body(
    body: Mapping[str, Any], shape: RequestShape, sizing: Sizing, priority: int
) -> dict[str, Any]:
    """The body sent to the engine: the caller's, at the interactive priority (a caller cannot
    choose its own), with the budget the reservation covers made explicit, and with the final
    usage chunk on a stream (settling needs it; the relay drops it unless asked for)."""
    payload = dict(body)
    payload["priority"] = priority
    if sizing.output_defaulted:
        payload[shape.budget_key] = sizing.max_output_tokens
    if shape.stream:
        options = body.get("stream_options")
        merged = dict(options) if isinstance(options, Mapping) else {}
        merged["include_usage"] = True
        payload["stream_options"] = merged
    return payload


# ---------------------------------------------------------------------------------------------
# Routing


@dataclass(frozen=True)
class NodeLoad:
    """One node's interactive headroom as its ledger snapshot shows it."""

    node: str
    ready: bool
    capacity_tokens: int
    interactive_room: int
    preemptible_batch: int
    """Tokens preempting batch could free."""
    pressure: float
    """Share of the pool held: interactive (reserved, or engine-observed non-batch use when
    that is larger, i.e. traffic that bypassed the gateway) plus batch."""


def node_load(snapshot: PoolSnapshot) -> NodeLoad:
    capacity = max(1, snapshot.capacity_tokens)
    held = max(snapshot.interactive_in_use, snapshot.observed_non_batch) + snapshot.batch_in_use
    preemptible = sum(
        lease.tokens
        for lease in snapshot.leases
        if lease.service_class is ServiceClass.BATCH and lease.preemptible
    )
    return NodeLoad(
        node=snapshot.node,
        ready=snapshot.ready,
        capacity_tokens=snapshot.capacity_tokens,
        interactive_room=snapshot.interactive_room,
        preemptible_batch=preemptible,
        pressure=min(1.0, held / capacity),
    )


def rank_nodes(loads: Sequence[NodeLoad], tokens: int) -> list[str]:
    """Nodes in the order to try a reservation of ``tokens``.

    First those where it fits without preempting anything, least pressed first (KV cache
    pressure slows every request on a node, not just new ones); then those where preempting
    batch makes room, least preemption first; then the rest, most room first (the ledger has
    the last word on each try).
    """

    def key(load: NodeLoad) -> tuple[int, float, int]:
        if load.ready and tokens <= load.interactive_room:
            return (0, load.pressure, -load.interactive_room)
        short = tokens - load.interactive_room
        if load.ready and short <= load.preemptible_batch:
            return (1, float(short), -load.interactive_room)
        return (2, 0.0, -load.interactive_room)

    return [load.node for load in sorted(loads, key=lambda x: (*key(x), x.node))]


# ---------------------------------------------------------------------------------------------
# Admission


def wait_budget_s(
    requested_s: float | None,
    default_s: float,
    client_read_timeout_s: float | None,
    cap_s: float = math.inf,
) -> float:
    """How long a request may wait for room: what the caller asked for (the gateway's header),
    else the deployment's default; never more than ``cap_s``, nor more than half of the
    client's own read timeout, so the answer (even a refusal) arrives before the client gives
    up."""
    budget = min(default_s if requested_s is None else requested_s, cap_s)
    if client_read_timeout_s is not None and client_read_timeout_s > 0:
        budget = min(budget, client_read_timeout_s / 2)
    return max(0.0, budget)


@dataclass(frozen=True)
class Admission:
    lease: Lease
    waited_s: float
    attempts: int


@dataclass(frozen=True)
class AdmissionTiming:
    first_backoff_s: float = 0.01
    max_backoff_s: float = 0.2
    retry_after_s: float = 1.0


async def admit(
    ledger: AsyncLedger,
    nodes: Sequence[str],
    sizing: Sizing,
    *,
    lease_id: str,
    owner: str,
    ttl_ms: int,
    max_wait_s: float,
    timing: AdmissionTiming | None = None,
    disconnected: Callable[[], Awaitable[bool]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    allow_preemption: bool = True,
) -> Admission:
    """Reserve ``sizing`` on the first of ``nodes`` (ranked by load when there are several)
    that admits it, preempting batch where that makes room (unless ``allow_preemption`` is
    False); wait up to ``max_wait_s``.

    Raises :class:`NoInteractiveRoom` or :class:`GatewayUnavailable` (with a retry hint) when
    the wait runs out, :class:`ReservationTooLarge` when no node could ever hold it, and
    :class:`ClientGone` when ``disconnected`` says the caller left. Reserve is idempotent per
    lease id, so one id serves every try.
    """
    t = timing or AdmissionTiming()
    if not nodes:
        raise GatewayUnavailable("no node is registered for this model", retry_after_s=5.0)
    start = clock()
    deadline = start + max_wait_s
    backoff = t.first_backoff_s
    attempts = 0
    while True:
        order = list(nodes)
        if len(order) > 1:
            order = await _ranked(ledger, order, sizing)
        permanent: list[Denial] = []
        reasons: set[str] = set()
        for node in order:
            attempts += 1
            try:
                outcome = await ledger.reserve(
                    node,
                    ServiceClass.INTERACTIVE,
                    sizing.prompt_tokens,
                    sizing.max_output_tokens,
                    n=sizing.sequences,
                    lease_id=lease_id,
                    owner=owner,
                    allow_preemption=allow_preemption,
                    ttl_ms=ttl_ms,
                )
            except LedgerUnavailable as exc:
                raise GatewayUnavailable(
                    f"the capacity ledger is unavailable: {exc}", retry_after_s=t.retry_after_s
                ) from exc
            except LedgerError as exc:
                # A node in Postgres whose pool the ledger does not (yet) know.
                reasons.add(f"{node}: {exc}")
                continue
            if isinstance(outcome, Lease):
                return Admission(outcome, clock() - start, attempts)
            reasons.add(outcome.reason.value)
            if outcome.permanent:
                permanent.append(outcome)
        if permanent and len(permanent) == len(order):
            raise _permanent_refusal(permanent[-1], sizing)
        now = clock()
        if now >= deadline:
            hint = max(t.retry_after_s, 1.0)
            if reasons <= {Reason.NO_ROOM.value}:
                raise NoInteractiveRoom(
                    f"No node serving this model has room for {sizing.sequences} x "
                    f"{sizing.sequence_tokens} tokens now, even after preempting batch work; "
                    f"waited {now - start:.2f} s. Retry after the time in Retry-After.",
                    retry_after_s=hint,
                )
            raise GatewayUnavailable(
                f"Cannot admit interactive requests now ({', '.join(sorted(reasons))}); "
                "retry after the time in Retry-After.",
                retry_after_s=hint,
            )
        if disconnected is not None and await disconnected():
            raise ClientGone("the caller disconnected while waiting for room")
        await asyncio.sleep(min(backoff, deadline - now))
        backoff = min(backoff * 2, t.max_backoff_s)


def _permanent_refusal(denial: Denial, sizing: Sizing) -> GatewayRefusal:
    if denial.reason is Reason.OVER_CLASS_LIMIT:
        return ContextLengthExceeded(
            f"prompt + max output ({sizing.sequence_tokens} tokens) is over the interactive "
            "class limit of the serving nodes",
            stage="exact",
            limit=None,
            param=None,
        )
    return ReservationTooLarge(
        f"the request needs {denial.tokens} KV tokens ({sizing.sequences} sequence(s) of "
        f"{sizing.sequence_tokens}), more than any serving node's pool could ever hold; "
        "lower n or max_tokens"
    )


async def _ranked(ledger: AsyncLedger, nodes: Sequence[str], sizing: Sizing) -> list[str]:
    try:
        snaps = await asyncio.gather(*(ledger.snapshot(n) for n in nodes))
    except BackfillError:
        return list(nodes)
    loads = [node_load(s) for s in snaps if s is not None]
    tokens = sizing.sequences * sizing.sequence_tokens
    ranked = rank_nodes(loads, tokens)
    # Nodes the ledger has no pool for go last: reserve will say why.
    return ranked + [n for n in nodes if n not in ranked]
