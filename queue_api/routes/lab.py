"""``/lab/lru`` and ``/lab/kv``: the traces the dashboard's Capacity lab page plays.

No API key: the lab computes a made-up stream against a made-up pool and touches no tenant's
data, Postgres or Redis, so it teaches anyone who opens the page. What anyone may make it do
is bounded three ways: the limits below (the largest trace, 4,096 requests against 64 slots,
costs the server about 0.3 s of CPU here, answering included: ``bench.anonymous``), a
per-address rate limit at the edge
(``queue_api.edge``), and one trace computed at a time per process, in a thread of its own
limiter, so lab calls never take the worker threads that authentication and the JSON API
run in, and queue behind each other instead of sharing the interpreter with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import anyio
import pydantic_core
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, Field

from backfill.errors import InvalidInput
from backfill_analysis import lab

router = APIRouter(prefix="/lab", tags=["lab"])


class LruParams(BaseModel):
    capacity_slots: int = Field(4, ge=1, le=lab.MAX_CAPACITY_SLOTS)
    working_set: int = Field(4, ge=1, le=lab.MAX_WORKING_SET)
    requests: int = Field(16, ge=1, le=lab.MAX_REQUESTS)


class KvParams(LruParams):
    prompt_tokens: int = Field(12, ge=0, le=lab.MAX_SEQUENCE_PART_TOKENS)
    output_tokens: int = Field(4, ge=1, le=lab.MAX_SEQUENCE_PART_TOKENS)
    interactive_every: int = Field(0, ge=0, le=lab.MAX_WORKING_SET)
    reserve_slots: int = Field(0, ge=0, le=lab.MAX_CAPACITY_SLOTS)
    max_preemptions: int = Field(3, ge=0, le=100)


def install_limiter(app: FastAPI) -> None:
    """One trace at a time per process: made in the app's lifespan (its event loop)."""
    app.state.lab_limiter = anyio.CapacityLimiter(1)


def _json(trace: lab.LruTrace | lab.KvTrace) -> bytes:
    # Serialised by pydantic-core straight from the dataclasses: ``dataclasses.asdict`` of
    # the longest trace cost five times what computing it did.
    fields = {f.name: getattr(trace, f.name) for f in dataclasses.fields(trace)}
    return pydantic_core.to_json({**fields, "hits": trace.hits})


async def _answer(request: Request, compute: Callable[[], lab.LruTrace | lab.KvTrace]) -> Response:
    limiter: anyio.CapacityLimiter = request.app.state.lab_limiter
    body = await anyio.to_thread.run_sync(lambda: _json(compute()), limiter=limiter)
    return Response(body, media_type="application/json")


@router.post("/lru")
async def lru(params: LruParams, request: Request) -> Response:
    """The stream through an LRU cache: eviction is automatic and free."""
    return await _answer(
        request,
        lambda: lab.simulate_lru(params.capacity_slots, params.working_set, params.requests),
    )


@router.post("/kv")
async def kv(params: KvParams, request: Request) -> Response:
    """The stream as sequences reserving KV tokens, each admission decided by the real
    policy (:func:`backfill.policy.decide`)."""
    try:
        config = lab.KvLabConfig(**params.model_dump())
    except ValueError as error:  # a reserve larger than the pool: only the pair is wrong
        raise InvalidInput(str(error)) from error
    return await _answer(request, lambda: lab.simulate_kv(config))
