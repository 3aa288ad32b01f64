"""How the retention purge paces itself: each transaction's size, and when a tick stops.

A maintenance tick purges ended batches a transaction at a time (``backfill.store.retention``).
Bounded in rows only, a tick "meant to take about a second" (50,000 rows in 5,000-row
transactions) took up to 16 s on a loaded server, and claims beside it slowed with it
(``bench.retention``, issue 35). So a tick is bounded in time: it starts no transaction once
its budget is spent, and leaves the rest to the next tick. And a transaction's size follows
how long the last one took: halved when it ran past its target, doubled (up to the configured
size) when it took under half of it, so each transaction, and the locks it holds, stays near
the target however slow the server is.

The plan is pure, as the dispatcher's are (``backfill.dispatch``): :func:`next_chunk` takes
the last transaction (its size, rows deleted, seconds), the tick's time and rows so far, and
says what comes next, and :func:`tick_over` whether a tick may begin one more job; the store
carries them out with a clock it is given.
"""

from __future__ import annotations

from dataclasses import dataclass

# The smallest transaction a slow server shrinks the purge to: under it, a transaction's
# fixed cost (its round trips, its commit) is most of what it does.
MIN_CHUNK_ROWS = 100


@dataclass(frozen=True)
class PurgePace:
    """What a purge tick is allowed (from the settings, ``maintenance.purge_pace``)."""

    budget_s: float = 1.0
    """A tick starts no transaction once it has run this long (it overruns it by at most one
    transaction, which the sizing keeps near ``target_s``)."""
    target_s: float = 0.2
    """How long one transaction should take."""
    max_rows: int = 5_000
    """The largest transaction."""
    rows_per_tick: int = 50_000
    """A tick starts no transaction once it has deleted this many rows, however fast they
    went (it passes it by less than one transaction)."""

    @property
    def min_rows(self) -> int:
        return min(MIN_CHUNK_ROWS, self.max_rows)


@dataclass(frozen=True)
class Chunk:
    """One transaction, as it went."""

    asked: int
    """The rows it was allowed to delete."""
    deleted: int
    seconds: float


@dataclass(frozen=True)
class NextChunk:
    """What the purge does after a transaction."""

    rows: int
    """The next transaction's size (kept for the next tick when this one stops)."""
    stop: str | None = None
    """Why the tick stops here (``"budget"``, ``"rows"``), or None to go on."""


def chunk_size(pace: PurgePace, last: Chunk) -> int:
    """The next transaction's size after ``last``: half when it ran past the target, double
    when a full one took under half of it (a short one, the end of a job's rows, says nothing
    about a full one's time), else the same; within [``min_rows``, ``max_rows``]."""
    if last.seconds > pace.target_s:
        size = last.asked // 2
    elif last.deleted >= last.asked and last.seconds * 2 <= pace.target_s:
        size = last.asked * 2
    else:
        size = last.asked
    return max(pace.min_rows, min(pace.max_rows, size))


def tick_over(pace: PurgePace, *, elapsed_s: float, rows_done: int) -> str | None:
    """Why a tick ``elapsed_s`` in with ``rows_done`` deleted starts nothing more:
    ``"rows"``, ``"budget"``, or None."""
    if rows_done >= pace.rows_per_tick:
        return "rows"
    if elapsed_s >= pace.budget_s:
        return "budget"
    return None


def next_chunk(pace: PurgePace, last: Chunk, *, elapsed_s: float, rows_done: int) -> NextChunk:
    """After ``last``, with the tick ``elapsed_s`` in and ``rows_done`` deleted: the next
    transaction's size, and why the tick stops here if it does.

    A transaction that found nothing does not stop the tick: it is how the purge learns a job
    has no more rows of one kind, and what follows it (the next kind, the job's own row) is
    how the tick gets past the job; stopped there, every tick would start with the same empty
    look and end. The tick looks at its time again before the next job."""
    rows = chunk_size(pace, last)
    if last.deleted == 0:
        return NextChunk(rows)
    return NextChunk(rows, tick_over(pace, elapsed_s=elapsed_s, rows_done=rows_done))


def first_chunk(pace: PurgePace, carried: int | None) -> int:
    """A tick's first transaction: the size the last tick ended at (a server slow then is
    likely slow now), or, with none before it, the smallest (doubling to the configured size
    takes a quiet server a few fast transactions; starting there cost a loaded one 1-5 s)."""
    if carried is None:
        return pace.min_rows
    return max(pace.min_rows, min(pace.max_rows, carried))
