"""vLLM's waiting queues as the step scheduler reads and borrows them: the interactive requests
waiting, in the order vLLM admits them, and the waiting batch requests set aside for one step
and put back after it (never given 0 tokens in vLLM's waiting scan, which vLLM 0.32 reads as
"admit nobody else this step"). vLLM's ``RequestQueue`` and ``Request`` come in as they are
(duck-typed): nothing here imports vLLM.

The queues are vLLM's two: ``kv_holding`` (requests that already hold KV blocks, a remote load
or a streaming input) and ``waiting``, in that order, as vLLM scans them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

SetAside = list[tuple[Any, list[Any]]]
"""Each queue that gave up requests, with those requests in its order."""


def waiting_interactive(
    kv_holding: Any,
    waiting: Any,
    bar: int,
    ordered: bool,
    startable: Callable[[Any, bool], bool],
) -> Iterator[Any]:
    """Waiting interactive requests (priority below ``bar``) that ``startable(request,
    kv_holding)`` says vLLM's scan could start, in the order it admits them. ``ordered``
    (vLLM's priority policy): the queues are ordered by priority, so this stops at the first
    batch request instead of walking a long batch backlog every step."""
    for queue in (kv_holding, waiting):
        if ordered and (not queue or queue.peek_request().priority >= bar):
            continue
        holding = queue is kv_holding
        for request in queue:
            if request.priority < bar:
                if startable(request, holding):
                    yield request
            elif ordered:
                break


def set_aside(kv_holding: Any, waiting: Any, bar: int, keep: frozenset[str]) -> SetAside:
    """Take the waiting batch requests (priority ``bar`` or above; but ``keep``) out of the
    queues for one step."""
    aside: SetAside = []
    for queue in (kv_holding, waiting):
        batch = [r for r in queue if r.priority >= bar and r.request_id not in keep]
        if batch:
            queue.remove_requests(batch)
            aside.append((queue, batch))
    return aside


def put_back(aside: SetAside) -> None:
    """Return what :func:`set_aside` took to the queues it came from."""
    for queue, batch in aside:
        for request in batch:
            queue.add_request(request)
