"""``/lab/lru`` and ``/lab/kv``: the traces the dashboard's Capacity lab page plays.

No API key: the lab computes a made-up stream against a made-up pool and touches no tenant's
data, Postgres or Redis, so it teaches anyone who opens the page. Its cost is bounded by the
limits below (at most 4,096 requests against at most 64 slots: well under a second), and the
route is synchronous, so it runs in the thread pool and never stalls the event loop.
"""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from backfill import lab
from backfill.errors import InvalidInput

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


def _trace(trace: lab.LruTrace | lab.KvTrace) -> JSONResponse:
    # asdict and a plain JSON response: validating thousands of steps again on the way out
    # would cost more than computing them.
    return JSONResponse({**asdict(trace), "hits": trace.hits})


@router.post("/lru")
def lru(params: LruParams) -> JSONResponse:
    """The stream through an LRU cache: eviction is automatic and free."""
    return _trace(lab.simulate_lru(params.capacity_slots, params.working_set, params.requests))


@router.post("/kv")
def kv(params: KvParams) -> JSONResponse:
    """The stream as sequences reserving KV tokens, each admission decided by the real
    policy (:func:`backfill.policy.decide`)."""
    try:
        config = lab.KvLabConfig(**params.model_dump())
    except ValueError as error:  # a reserve larger than the pool: only the pair is wrong
        raise InvalidInput(str(error)) from error
    return _trace(lab.simulate_kv(config))
