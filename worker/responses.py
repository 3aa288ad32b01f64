"""One Responses attempt (``/v1/responses``): the engine's event stream, folded.

The request is streamed, not awaited whole: each event tells the dispatcher the engine is
alive (the stall watch), the first output tells the work budget the prompt left prefill,
and the output deltas so far tell the ledger how much work a preemption would lose. Closing
the stream (a preemption, a lost lease, shutdown) drops the connection, which makes vLLM
abort the request and free its blocks.

Nothing partial is kept: a preempted Responses item runs again from the start (continuing
one would need the partial output turned into an assistant item, and the two attempts'
output items stitched together). The result line's ``response.body`` is the Response object
of the stream's last event (``response.completed``, or ``response.incomplete``), as vLLM
sends it, with ``model`` the name the line gave. A stream that ends without one, or says
``response.failed`` or ``error``, is an engine failure, not a result.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from backfill.engine.protocol import EngineFailed, EngineRejected

__all__ = ["Responded", "ResponseStream", "response_result"]

FINAL_EVENTS = frozenset({"response.completed", "response.incomplete"})
"""The events that carry the finished Response (vLLM ends an answer cut by
``max_output_tokens`` with ``response.completed`` and ``status: incomplete``; OpenAI with
``response.incomplete``)."""


@dataclass(frozen=True, slots=True)
class Responded:
    """A Responses attempt's answer."""

    body: dict[str, Any]
    """The result line's ``response.body``."""
    input_tokens: int
    output_tokens: int
    """The engine's usage: what it prefilled and generated, for the reservation check and
    the Batch usage."""


def _bad(why: str) -> EngineFailed:
    return EngineFailed(200, f"the responses stream {why}")


def _count(usage: Mapping[str, Any], key: str) -> int:
    value = usage.get(key)
    if type(value) is not int or value < 0:
        raise _bad(f"ended with a response without usage.{key}")
    return value


def response_result(response: Mapping[str, Any], *, model: str) -> Responded:
    """The result of a finished Response object; raises :class:`EngineFailed` for one
    without the shape (an ``output`` list, ``usage`` with its token counts)."""
    if not isinstance(response.get("output"), list):
        raise _bad("ended with a response without an output list")
    usage = response.get("usage")
    if not isinstance(usage, Mapping):
        raise _bad("ended with a response without usage")
    body = dict(response)
    body["object"] = body.get("object") or "response"
    body["model"] = model
    return Responded(body, _count(usage, "input_tokens"), _count(usage, "output_tokens"))


@dataclass(slots=True)
class ResponseStream:
    """The events of one streamed Responses request, folded as they come."""

    deltas: int = 0
    """Output deltas seen (text, reasoning, tool arguments): about one token each, which is
    what progress needs; the final usage is the exact count."""
    final: dict[str, Any] | None = field(default=None, repr=False)

    def add(self, event: Mapping[str, Any]) -> bool:
        """Fold one event; True when it carried new output. Raises for an error event."""
        kind = event.get("type")
        if kind in FINAL_EVENTS:
            response = event.get("response")
            if not isinstance(response, dict):
                raise _bad(f"sent {kind} without a response object")
            self.final = response
            return False
        if kind == "response.failed":
            response = event.get("response")
            error = response.get("error") if isinstance(response, Mapping) else None
            raise EngineFailed(500, f"the engine failed the response: {error!r:.500}")
        if kind == "error":
            code = event.get("code")
            message = str(event.get("message") or event)
            if isinstance(code, int) and 400 <= code < 500:
                raise EngineRejected(code, message, dict(event))
            raise EngineFailed(code if isinstance(code, int) else 500, message)
        if isinstance(kind, str) and kind.endswith(".delta") and event.get("delta"):
            self.deltas += 1
            return True
        return False

    def result(self, *, model: str) -> Responded:
        """The answer, once the stream ended; raises if it ended without a final event."""
        if self.final is None:
            raise _bad("ended without response.completed")
        return response_result(self.final, model=model)
