"""One embeddings attempt (``/v1/embeddings``): one non-streaming call, its answer checked.

An embedding is all prefill: nothing streams, and nothing partial is worth keeping. A
preemption cancels the call, which drops the connection, which makes vLLM abort the request
and free its blocks; the item then runs again from the start.

The result line's ``response.body`` is the engine's answer as vLLM returns it (OpenAI's
``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage"}``, plus vLLM's ``id`` and ``created``), with ``model`` the name the line gave. An
answer without that shape is an engine failure, not a result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backfill.engine.protocol import Engine, EngineFailed
from backfill.prefill import embedding_inputs

__all__ = ["Embedded", "embed", "embedding_body"]


@dataclass(frozen=True, slots=True)
class Embedded:
    """An embeddings attempt's answer."""

    body: dict[str, Any]
    """The result line's ``response.body``."""
    prompt_tokens: int
    """What the engine says it prefilled (its usage), for the reservation check."""


def _bad(why: str) -> EngineFailed:
    return EngineFailed(200, f"the embeddings answer {why}")


def embedding_body(answer: Mapping[str, Any], *, model: str, inputs: int) -> Embedded:
    """The result of an answer to a request of ``inputs`` inputs; raises
    :class:`EngineFailed` for one that is not an embedding response with one vector per input
    (indexes 0 to ``inputs - 1``, in order)."""
    data = answer.get("data")
    if type(data) is not list:
        raise _bad("has no data list")
    for position, entry in enumerate(data):
        if not isinstance(entry, Mapping):
            raise _bad(f"holds a non-object at data[{position}]")
        if entry.get("index") != position:
            raise _bad(f"has index {entry.get('index')!r} at data[{position}]")
        if not isinstance(entry.get("embedding"), list | str):
            raise _bad(f"has no embedding at data[{position}]")
    if len(data) != inputs:
        raise _bad(f"holds {len(data)} embeddings for {inputs} inputs")
    usage = answer.get("usage")
    prompt = usage.get("prompt_tokens") if isinstance(usage, Mapping) else None
    if type(prompt) is not int or prompt < 0:
        raise _bad("has no usage.prompt_tokens")
    body = dict(answer)
    body["object"] = body.get("object") or "list"
    body["model"] = model
    return Embedded(body, prompt)


async def embed(
    engine: Engine,
    request: Mapping[str, Any],
    *,
    model: str,
    priority: int,
    request_id: str,
) -> Embedded:
    """Run ``request`` (its ``model`` set) on ``engine`` at ``priority``; engine errors
    propagate as the engine client raises them."""
    inputs = len(embedding_inputs(request.get("input")))
    answer = await engine.embed(request, priority=priority, request_id=request_id)
    return embedding_body(answer, model=model, inputs=inputs)
