"""How the retention purge paces itself (``backfill.purge_pace``): a transaction's size follows
the last one's time against the target, and a tick stops between two once its time budget (or
its rows) is spent."""

from __future__ import annotations

import pytest

from backfill.purge_pace import (
    MIN_CHUNK_ROWS,
    Chunk,
    NextChunk,
    PurgePace,
    chunk_size,
    first_chunk,
    next_chunk,
    tick_over,
)

PACE = PurgePace(budget_s=1.0, target_s=0.2, max_rows=5_000, rows_per_tick=50_000)


@pytest.mark.parametrize(
    ("last", "size"),
    [
        # Past the target: half.
        (Chunk(asked=5_000, deleted=5_000, seconds=0.9), 2_500),
        (Chunk(asked=2_500, deleted=2_500, seconds=0.21), 1_250),
        # ... but never under the floor.
        (Chunk(asked=150, deleted=150, seconds=3.0), MIN_CHUNK_ROWS),
        (Chunk(asked=MIN_CHUNK_ROWS, deleted=MIN_CHUNK_ROWS, seconds=3.0), MIN_CHUNK_ROWS),
        # Within the target and over half of it: the same.
        (Chunk(asked=1_250, deleted=1_250, seconds=0.2), 1_250),
        (Chunk(asked=1_250, deleted=1_250, seconds=0.15), 1_250),
        # A full one under half of it: double ...
        (Chunk(asked=1_250, deleted=1_250, seconds=0.1), 2_500),
        (Chunk(asked=100, deleted=100, seconds=0.0), 200),
        # ... up to the configured size.
        (Chunk(asked=4_000, deleted=4_000, seconds=0.01), 5_000),
        (Chunk(asked=5_000, deleted=5_000, seconds=0.01), 5_000),
        # A short one (the end of a job's rows) says nothing about a full one's time.
        (Chunk(asked=1_250, deleted=3, seconds=0.01), 1_250),
        # ... unless even it ran slow.
        (Chunk(asked=1_250, deleted=3, seconds=0.5), 625),
    ],
)
def test_a_transaction_is_sized_from_the_last_ones_time(last: Chunk, size: int) -> None:
    assert chunk_size(PACE, last) == size


@pytest.mark.parametrize(
    ("last", "elapsed_s", "rows_done", "then"),
    [
        # Time left: go on, at the size the last one's time says.
        (Chunk(5_000, 5_000, 0.1), 0.1, 5_000, NextChunk(5_000)),
        (Chunk(5_000, 5_000, 0.5), 0.5, 5_000, NextChunk(2_500)),
        # The budget spent: stop between transactions, the size kept for the next tick.
        (Chunk(5_000, 5_000, 0.5), 1.0, 10_000, NextChunk(2_500, stop="budget")),
        (Chunk(2_500, 2_500, 15.8), 15.8, 2_500, NextChunk(1_250, stop="budget")),
        # The rows spent, however fast they went.
        (Chunk(5_000, 5_000, 0.01), 0.1, 50_000, NextChunk(5_000, stop="rows")),
        (Chunk(5_000, 5_000, 0.01), 0.1, 52_000, NextChunk(5_000, stop="rows")),
        # A transaction that found nothing (a job's rows of one kind are gone) never stops
        # the tick: what follows it is how the tick gets past that job.
        (Chunk(2_500, 0, 0.5), 3.0, 2_500, NextChunk(1_250)),
        (Chunk(5_000, 0, 0.01), 0.1, 50_000, NextChunk(5_000)),
    ],
)
def test_a_tick_stops_between_transactions_once_its_time_or_rows_are_spent(
    last: Chunk, elapsed_s: float, rows_done: int, then: NextChunk
) -> None:
    assert next_chunk(PACE, last, elapsed_s=elapsed_s, rows_done=rows_done) == then


@pytest.mark.parametrize(
    ("elapsed_s", "rows_done", "over"),
    [(0.5, 10_000, None), (1.0, 10_000, "budget"), (0.5, 50_000, "rows"), (2.0, 60_000, "rows")],
)
def test_a_tick_begins_no_more_jobs_once_its_time_or_rows_are_spent(
    elapsed_s: float, rows_done: int, over: str | None
) -> None:
    assert tick_over(PACE, elapsed_s=elapsed_s, rows_done=rows_done) == over


@pytest.mark.parametrize(
    ("carried", "first"),
    [
        (None, MIN_CHUNK_ROWS),  # a first tick: the smallest, doubled while fast
        (1_250, 1_250),  # then where the last tick ended
        (20, MIN_CHUNK_ROWS),
        (9_000, 5_000),  # the configured size lowered since
    ],
)
def test_a_tick_starts_at_the_size_the_last_one_ended_at(carried: int | None, first: int) -> None:
    assert first_chunk(PACE, carried) == first


def test_a_configured_size_under_the_floor_is_kept_as_it_is() -> None:
    tiny = PurgePace(max_rows=4)
    assert chunk_size(tiny, Chunk(4, 4, 9.0)) == 4
    assert first_chunk(tiny, None) == 4
    assert first_chunk(tiny, 9) == 4
