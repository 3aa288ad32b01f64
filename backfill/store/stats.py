"""Figures over the store: backlogs (capacity planning, fair share), and the metrics read at
scrape time, each cheap (counters, small tables, or an index range).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import text

from backfill import fairshare
from backfill.states import ITEM_ACTIVE, ITEM_CLAIMABLE, ItemState, JobState
from backfill.store.counters import COUNTERS_JOIN
from backfill.store.database import Database
from backfill.store.records import FinishedTokenStats

# Items per state of one job by COUNT(*): the slow truth the counters are checked against.
COUNTED_STATES_OF_JOB = "SELECT state, count(*) FROM items WHERE job_id = :j GROUP BY state"

# Items of a job not yet finished, from its counters.
_UNFINISHED = " + ".join(f"c.{s.value}" for s in sorted(ITEM_CLAIMABLE | ITEM_ACTIVE))

# Worst-case tokens (prompt + max output) still to spend per tenant, with its weight (tenants
# with nothing unfinished left out). Read from the unfinished jobs' counters, pro rata as the
# quota check reads them (``ENQUEUED_TOKENS``), never from items: a create plans its deadline
# with this, and one tenant's million queued items must not make another's create scan them.
# The figure is exact while a job's unfinished items are alike in size; otherwise it is off by
# their spread, and it leaves out what preempted items already generated (deadline planning is
# an estimate). The job states are those of ``ix_jobs_open_deadline``, so the jobs are found
# by that index: the cost grows with the unfinished jobs, not with anyone's items.
BACKLOG_BY_TENANT = (
    "SELECT t.id, t.weight, b.tokens FROM (SELECT j.tenant_id, "
    f"sum((c.prompt_tokens + c.max_output_tokens) * ({_UNFINISHED}) / greatest(c.total, 1)) "
    f"AS tokens, sum({_UNFINISHED}) AS unfinished FROM jobs j {COUNTERS_JOIN} "
    "WHERE j.state IN ('validating', 'in_progress', 'cancelling') GROUP BY j.tenant_id) b "
    "JOIN tenants t ON t.id = b.tenant_id WHERE b.unfinished > 0"
)

# The same over every tenant.
BACKLOG_TOKENS = f"SELECT coalesce(sum(b.tokens), 0) FROM ({BACKLOG_BY_TENANT}) b"

# Jobs per state (the states with none are filled in by the caller).
JOB_STATE_TOTALS = "SELECT state, count(*) FROM jobs GROUP BY state"

# Output tokens of the items that succeeded in the last seconds (throughput figure).
OUTPUT_TOKENS_FINISHED_WITHIN = (
    "SELECT coalesce(sum(output_tokens), 0) FROM items "
    "WHERE finished_at IS NOT NULL "
    "AND finished_at > now() - make_interval(secs => :s) "
    "AND state = 'succeeded'"
)


class Stats:
    """Backlogs and metrics."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def counted_states(self, job_id: str) -> dict[ItemState, int]:
        """COUNT(*) by state: the slow truth the counters are checked against."""
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(COUNTED_STATES_OF_JOB),
                {"j": job_id},
            ).all()
        return {ItemState(r[0]): int(r[1]) for r in rows}

    def backlog_tokens(self) -> int:
        """Worst-case tokens (prompt + max output) of every item not yet finished, from the
        unfinished jobs' counters (see ``BACKLOG_BY_TENANT``)."""
        with self._db.transaction() as conn:
            return int(conn.execute(text(BACKLOG_TOKENS)).scalar_one())

    def backlog_by_tenant(self) -> list[fairshare.TenantBacklog]:
        """:meth:`backlog_tokens` per tenant, with each tenant's weight (tenants with none
        are left out)."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(BACKLOG_BY_TENANT)).all()
        return [fairshare.TenantBacklog(r[0], float(r[1]), int(r[2])) for r in rows]

    def item_state_totals(self) -> dict[ItemState, int]:
        """Items per state over every job, summed from the counters (no scan of items)."""
        states = list(ItemState)
        cols = ", ".join(f"coalesce(sum({s.value}), 0)" for s in states)
        with self._db.transaction() as conn:
            row = conn.execute(text(f"SELECT {cols} FROM job_counters")).one()
        return {s: int(n) for s, n in zip(states, row, strict=True)}

    def job_state_totals(self) -> dict[JobState, int]:
        """Jobs per state (every state, zeros included)."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(JOB_STATE_TOTALS)).all()
        found = {JobState(r[0]): int(r[1]) for r in rows}
        return {s: found.get(s, 0) for s in JobState}

    def finished_token_stats(
        self,
        since: datetime | None,
        bounds: Sequence[int],
        *,
        lookback_s: float,
        lag_s: float,
    ) -> FinishedTokenStats:
        """Token figures of the items that succeeded after ``since`` (or, when None, in the
        last ``lookback_s``) and up to ``lag_s`` ago, by the database's clock.

        The upper end trails now by ``lag_s`` so that a finish committed a moment late (its
        ``finished_at`` is its transaction's start) still falls after the returned
        ``until``, which the caller passes back as the next ``since``.
        """
        wanted = [int(b) for b in bounds]
        buckets = ", ".join(
            f"count(i.id) FILTER (WHERE coalesce(i.{col}, 0) <= {b})"
            for col in ("prompt_tokens", "output_tokens")
            for b in wanted
        )
        with self._db.transaction() as conn:
            row = conn.execute(
                text(
                    "WITH w AS (SELECT coalesce(CAST(:since AS timestamptz), "
                    "now() - make_interval(secs => :lookback)) AS lo, "
                    "now() - make_interval(secs => :lag) AS hi) "
                    "SELECT w.hi, count(i.id), coalesce(sum(i.prompt_tokens), 0), "
                    "coalesce(sum(i.output_tokens), 0)"
                    + (f", {buckets}" if buckets else "")
                    + " FROM w LEFT JOIN items i ON i.finished_at IS NOT NULL "
                    "AND i.finished_at > w.lo AND i.finished_at <= w.hi "
                    "AND i.state = 'succeeded' GROUP BY w.hi"
                ),
                {"since": since, "lookback": lookback_s, "lag": lag_s},
            ).one()
        n = len(wanted)
        return FinishedTokenStats(
            until=row[0],
            count=int(row[1]),
            prompt_sum=int(row[2]),
            output_sum=int(row[3]),
            prompt_le=[int(v) for v in row[4 : 4 + n]],
            output_le=[int(v) for v in row[4 + n : 4 + 2 * n]],
        )

    def output_tokens_finished_within(self, seconds: float) -> int:
        """Output tokens of the items that succeeded in the last ``seconds``."""
        with self._db.transaction() as conn:
            return int(
                conn.execute(
                    text(OUTPUT_TOKENS_FINISHED_WITHIN),
                    {"s": seconds},
                ).scalar_one()
            )
