"""Stopping background tasks for good, though a cancellation may be lost.

Python 3.11's ``asyncio.wait_for`` drops a cancellation that arrives in the loop iteration in
which the call it waits on completes: it returns that call's result instead of raising
(CPython gh-86296, fixed by 3.12's rewrite of ``wait_for``). redis-py wraps every command in
one (its ``socket_timeout``), and Backfill's loops wait on events through one, so a loop that
is cancelled once may simply go on: measured with a loop of ``wait_for`` calls, 60 of 100
single cancellations were lost. Code that cancelled a loop once and awaited it then waited for
good: a worker's dispatcher that did not stop at SIGTERM, a test's stop that hung until its
own 30 s bound.

:func:`cancel_and_wait` cancels again, every ``retry_s``, whatever has not ended, so a lost
cancellation costs one retry, and gives up after ``patience_s`` (it returns what still runs,
for the caller to report). Only for tasks whose cancellation needs no cleanup of their own:
a task that catches its cancellation to clean up (an attempt writing its requeue) must not be
cancelled again in the middle of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RETRY_S = 0.1
"""How long a cancelled task has to end before it is cancelled again."""

PATIENCE_S = 10.0
"""How long to keep cancelling before giving up on a task (one that swallows every
cancellation: a bug of its own, reported by the caller)."""


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[object]],
    *,
    retry_s: float = RETRY_S,
    patience_s: float = PATIENCE_S,
) -> set[asyncio.Task[object]]:
    """Cancel ``tasks`` and wait until each has ended, cancelling again every ``retry_s``
    those still running; returns those still running after ``patience_s`` (none, normally).
    A task that ended on an exception of its own has it retrieved, not raised: the caller
    reads ``task.exception()`` where it cares. A cancellation of the caller is raised."""
    every = list(tasks)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    pending = {t for t in every if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(retry_s, left))
    for task in every:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: asyncio does not log it as never retrieved
    return pending
