"""Per-job counters: items per state and token totals, kept in the same transaction as the
items they count.

A job's counters are spread over a few shard rows: every connection writes its own
(``pg_backend_pid() % COUNTER_SHARDS``), so concurrent workers finishing items of one job do
not queue on one row lock through each other's commits; readers sum the shards. Rows are
always written in job-id order, the one lock order every writer follows, so writers cannot
deadlock on them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from sqlalchemy import Connection, text

from backfill.states import ITEM_CLAIMABLE, ItemState

COUNTED_STATES: tuple[ItemState, ...] = tuple(ItemState)

# Shard rows per job (see the module comment).
COUNTER_SHARDS = 16

# The columns of a counter row, in the order readers select them.
COUNTER_COLUMNS = (
    "total",
    *(s.value for s in COUNTED_STATES),
    "prompt_tokens",
    "max_output_tokens",
    "output_tokens",
    "input_tokens",
)

# A job's counters are spread over a few shard rows (see add_to_counters); readers sum them.
COUNTERS_JOIN = (
    "CROSS JOIN LATERAL (SELECT "
    + ", ".join(f"coalesce(sum({c}), 0)::bigint AS {c}" for c in COUNTER_COLUMNS)
    + " FROM job_counters WHERE job_id = j.id) c"
)


def counters_cte(deltas: Mapping[str, str]) -> str:
    """A ``cnt`` CTE that adds aggregates over the ``moved`` CTE to the counters, inside the
    same statement (one round trip). ``deltas`` maps counter columns to aggregate
    expressions; only those columns are written. Rows are written in job-id order, the lock
    order every counter writer follows (see ``add_to_counters``)."""
    cols = list(deltas)
    return (
        f"cnt AS (INSERT INTO job_counters (job_id, shard, {', '.join(cols)}) "
        f"SELECT job_id, pg_backend_pid() % {COUNTER_SHARDS}, {', '.join(deltas.values())} "
        "FROM moved GROUP BY job_id ORDER BY job_id ON CONFLICT (job_id, shard) DO UPDATE SET "
        + ", ".join(f"{c} = job_counters.{c} + EXCLUDED.{c}" for c in cols)
        + ")"
    )


def moved_from(state: ItemState) -> str:
    return f"-count(*) FILTER (WHERE from_state = '{state.value}')"


# The counter moves of each batch statement, added by its ``cnt`` CTE: a claim (from each
# claimable state to reserved), a start, an unclaim, and a finish (with its output tokens).
CNT_CLAIM = counters_cte(
    {s.value: moved_from(s) for s in sorted(ITEM_CLAIMABLE)} | {"reserved": "count(*)"}
)
CNT_START = counters_cte({"reserved": "-count(*)", "running": "count(*)"})
CNT_UNCLAIM = counters_cte({"reserved": "-count(*)", "queued": "count(*)"})
CNT_FINISH = counters_cte(
    {
        "running": "-count(*)",
        "succeeded": "count(*) FILTER (WHERE s = 'succeeded')",
        "failed": "count(*) FILTER (WHERE s = 'failed')",
        "output_tokens": "coalesce(sum(out), 0)",
        "input_tokens": "coalesce(sum(pt) FILTER (WHERE s = 'succeeded'), 0)",
    }
)


def bump_counters(
    conn: Connection,
    moves: Sequence[tuple[str, ItemState, ItemState]],
    *,
    output_tokens: dict[str, int] | None = None,
) -> None:
    """Apply (job_id, from, to) item moves to the per-job counters."""
    deltas: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for job_id, source, target in moves:
        deltas[job_id][source.value] -= 1
        deltas[job_id][target.value] += 1
    for job_id, n in (output_tokens or {}).items():
        deltas[job_id]["output_tokens"] += n
    add_to_counters(conn, deltas)


def add_to_counters(conn: Connection, deltas: Mapping[str, Mapping[str, int]]) -> None:
    """Add column deltas to each job's counters.

    Every connection writes its own shard row of a job (``pg_backend_pid() % SHARDS``), so
    concurrent workers finishing items of one job do not queue on one row lock through each
    other's commits; readers sum the shards. Rows are touched in job-id order, the one lock
    order every writer follows, so writers cannot deadlock.
    """
    for job_id in sorted(deltas):
        cols = {c: d for c, d in deltas[job_id].items() if d}
        if not cols:
            continue
        names = sorted(cols)
        conn.execute(
            text(
                f"INSERT INTO job_counters (job_id, shard, {', '.join(names)}) "
                f"VALUES (:job, pg_backend_pid() % {COUNTER_SHARDS}, "
                + ", ".join(f":{c}" for c in names)
                + ") ON CONFLICT (job_id, shard) DO UPDATE SET "
                + ", ".join(f"{c} = job_counters.{c} + EXCLUDED.{c}" for c in names)
            ),
            {"job": job_id, **cols},
        )
