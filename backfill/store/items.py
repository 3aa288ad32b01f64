"""Item transitions after a claim: results, preemptions, give-backs, failures, requeues,
expiries, and the ending of a job's items; and a job's items read in line order.

Single-item moves go through :func:`backfill.store.moves.move_item` (one guarded UPDATE,
the attempt's row, the counters); batch moves are one statement each, counters included.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sqlalchemy import text

from backfill.errors import IllegalTransition
from backfill.states import ITEM_ACTIVE, ITEM_CLAIMABLE, AttemptOutcome, ItemState
from backfill.store.counters import CNT_FINISH, bump_counters
from backfill.store.database import Database
from backfill.store.driver import array_literal, single
from backfill.store.moves import (
    NOT_BEFORE,
    ItemMove,
    check_moves,
    encode_partial,
    in_id_order,
    move_item,
)
from backfill.store.records import ActiveLeaseRow, Finish, ItemRecord
from backfill.store.recovery import active_row

# running -> succeeded/failed for many attempts still holding their fence; ends their attempt rows
# and moves the counters. The state is checked as ``(...) IS TRUE``, a filter no index can
# answer, so each item is found by its primary key: as a plain ``i.state = 'running'`` the
# planner read the partial indexes of active items instead, every entry left by each item that
# ever ran until vacuum comes (9,600 read to finish 64 after a few seconds of churn), and the
# finish cost twice its server time (tests/integration/test_batch_plans.py).
FINISH = (
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
    "CAST(:att AS int[]), CAST(:fen AS bigint[]), CAST(:st AS text[]), "
    "CAST(:res AS text[]), CAST(:err AS text[]), CAST(:out AS int[]), "
    "CAST(:pt AS int[])) AS v(id, a, f, s, res, err, out, pt)), "
    "moved AS (UPDATE items i SET state = v.s, result = v.res, error = v.err, "
    "  output_tokens = v.out, prompt_tokens = coalesce(v.pt, i.prompt_tokens), "
    "  lease_id = NULL, lease_expires_at = NULL, finished_at = now(), "
    "  updated_at = now() FROM v WHERE i.id = v.id AND i.attempt = v.a "
    "  AND i.fencing_token = v.f AND (i.state = 'running') IS TRUE "
    "  RETURNING i.id, i.job_id, i.attempt, v.s, v.out, i.prompt_tokens AS pt), "
    f"{CNT_FINISH}, "
    "att AS (UPDATE attempts t SET ended_at = now(), outcome = m.s, "
    "  output_tokens = m.out FROM moved m "
    "  WHERE t.item_id = m.id AND t.attempt = m.attempt) "
    "SELECT id FROM moved"
)

# Expire or cancel a job's unfinished items of the given sources; returns each with its old lease
# fields.
END_ITEMS = (
    "WITH old AS (SELECT id, state, node, attempt, lease_id, fencing_token, "
    "  reservation_tokens, lease_expires_at FROM items "
    # In id order, as every statement that locks many items: no two can wait in a cycle.
    "  WHERE job_id = :j AND state = ANY(:src) ORDER BY id FOR UPDATE), "
    "moved AS (UPDATE items i SET state = :to, lease_id = NULL, "
    "  lease_expires_at = NULL, finished_at = now(), updated_at = now() "
    "  FROM old WHERE i.id = old.id "
    "  RETURNING i.id, i.job_id, i.deadline, i.preemptions, i.partial_tokens, "
    "  old.state AS from_state, old.node, old.attempt, old.lease_id, "
    "  old.fencing_token, old.reservation_tokens, old.lease_expires_at), "
    "att AS (INSERT INTO attempts (item_id, attempt, node, ended_at, outcome) "
    "  SELECT id, attempt, coalesce(node, ''), now(), :to FROM moved "
    "  WHERE from_state IN ('reserved', 'running') "
    "  ON CONFLICT (item_id, attempt) DO UPDATE SET ended_at = now(), "
    "  outcome = EXCLUDED.outcome) "
    "SELECT * FROM moved"
)

# A page of a job's items after a line, in line order, of some states or all.
ITEMS_PAGE = (
    "SELECT id, job_id, line_no, custom_id, state, attempt, result, error, "
    "output_tokens, preemptions FROM items WHERE job_id = :j AND line_no > :a "
    "AND (CAST(:s AS text[]) IS NULL OR state = ANY(:s)) "
    "ORDER BY line_no LIMIT :l"
)

# The single-item moves of the worker's path (see backfill.store.moves for the guard).
# The lease is gone in each: its tokens are the ledger's again.

_GONE = "lease_id = NULL, lease_expires_at = NULL"
_PROGRESS = "partial_output = :partial_output, partial_tokens = :partial_tokens"

# The engine request was aborted for interactive work: count it, keep its progress.
PREEMPT = ItemMove(
    ItemState.RUNNING,
    ItemState.PREEMPTED,
    AttemptOutcome.PREEMPTED,
    f"preemptions = preemptions + 1, {_PROGRESS}, {_GONE}",
)
# A claim the node had no slack for: claimable again after ``:retry`` seconds.
DEFER = ItemMove(
    ItemState.RESERVED,
    ItemState.DEFERRED,
    AttemptOutcome.DEFERRED,
    f"not_before = {NOT_BEFORE}, {_GONE}, fencing_token = NULL",
)
# A claim given back unstarted (the worker stops, or will not start it): queued again.
RELEASE_UNSTARTED = ItemMove(
    ItemState.RESERVED,
    ItemState.QUEUED,
    AttemptOutcome.RELEASED,
    f"not_before = {NOT_BEFORE}, {_GONE}, fencing_token = NULL",
)
# A claimed item that cannot run at all (bad request): failed with ``:error``.
FAIL_CLAIMED = ItemMove(
    ItemState.RESERVED,
    ItemState.FAILED,
    AttemptOutcome.FAILED,
    f"error = :error, {_GONE}, finished_at = now()",
)
# A running item that failed for good (retry cap reached): failed with ``:error``.
FAIL_RUNNING = ItemMove(
    ItemState.RUNNING,
    ItemState.FAILED,
    AttemptOutcome.FAILED,
    f"error = :error, {_GONE}, finished_at = now()",
)
# A running attempt stopped short (engine down, shutdown, lease lost): queued again after
# ``:retry`` seconds with its progress kept for the next attempt.
REQUEUE = ItemMove(
    ItemState.RUNNING,
    ItemState.QUEUED,
    AttemptOutcome.RELEASED,
    f"{_PROGRESS}, {_GONE}, fencing_token = NULL, not_before = {NOT_BEFORE}",
)
# A claimed item that cannot finish before its deadline: expired unstarted, with ``:error``.
EXPIRE_CLAIMED = ItemMove(
    ItemState.RESERVED,
    ItemState.EXPIRED,
    AttemptOutcome.EXPIRED,
    f"error = :error, {_GONE}, finished_at = now()",
)


class Items:
    """Moving and reading a job's items."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def finish(self, finishes: Sequence[Finish]) -> list[int]:
        """running -> succeeded/failed for many items at once; returns the ids that applied.

        A finish whose attempt or fencing token no longer matches (the item was reaped,
        preempted or cancelled meanwhile) is dropped: the result is never written twice.
        """
        for f in finishes:
            if f.state not in (ItemState.SUCCEEDED, ItemState.FAILED):
                raise IllegalTransition(f"finish() writes succeeded or failed, not {f.state}")
        if not finishes:
            return []
        finishes = in_id_order(finishes, lambda f: f.item_id)
        # One statement is the whole transaction: sent alone, it commits as it ends (durable,
        # one round trip instead of two).
        return single(
            self._db.engine,
            FINISH,
            {
                "ids": array_literal(f.item_id for f in finishes),
                "att": array_literal(f.attempt for f in finishes),
                "fen": array_literal(f.fencing_token for f in finishes),
                "st": array_literal(f.state.value for f in finishes),
                "res": array_literal(f.result for f in finishes),
                "err": array_literal(f.error for f in finishes),
                "out": array_literal(f.output_tokens for f in finishes),
                "pt": array_literal(f.prompt_tokens for f in finishes),
            },
        )

    def preempt(
        self,
        item_id: int,
        attempt: int,
        fencing_token: int,
        *,
        partial_output: str | None,
        partial_tokens: int,
    ) -> None:
        """running -> preempted: the engine request was aborted; keep its progress."""
        progress = {
            "partial_output": encode_partial(partial_output),
            "partial_tokens": partial_tokens,
        }
        with self._db.transaction() as conn:
            move_item(
                conn,
                PREEMPT,
                item_id,
                attempt,
                fencing_token=fencing_token,
                values=progress,
                output_tokens=partial_tokens,
            )

    def give_back(
        self,
        item_id: int,
        attempt: int,
        target: ItemState,
        *,
        retry_after_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        """reserved -> deferred (no slack) or queued (unstarted), claimable again
        ``retry_after_s`` from now on Postgres' clock (at once when None)."""
        moves = {ItemState.DEFERRED: DEFER, ItemState.QUEUED: RELEASE_UNSTARTED}
        if target not in moves:
            raise IllegalTransition(f"give_back() moves to deferred or queued, not {target}")
        with self._db.transaction() as conn:
            move_item(
                conn,
                moves[target],
                item_id,
                attempt,
                values={"retry": retry_after_s},
                detail=detail,
            )

    def fail(
        self, item_id: int, attempt: int, error: str, *, fencing_token: int | None = None
    ) -> None:
        """An attempt's item fails for good (bad request, retry cap reached): a claimed one
        without a fencing token, a running one under its token."""
        move = FAIL_CLAIMED if fencing_token is None else FAIL_RUNNING
        with self._db.transaction() as conn:
            move_item(
                conn,
                move,
                item_id,
                attempt,
                fencing_token=fencing_token,
                values={"error": error},
                detail=error,
            )

    def requeue(
        self,
        item_id: int,
        attempt: int,
        fencing_token: int,
        *,
        partial_output: str | None,
        partial_tokens: int,
        detail: str,
        retry_after_s: float | None = None,
    ) -> None:
        """running -> queued: the attempt stopped (engine down, worker shutting down, lease
        lost, a worker error); its progress is kept for the next attempt, which waits
        ``retry_after_s`` from now (Postgres' clock) when given."""
        values = {
            "partial_output": encode_partial(partial_output),
            "partial_tokens": partial_tokens,
            "retry": retry_after_s,
        }
        with self._db.transaction() as conn:
            move_item(
                conn,
                REQUEUE,
                item_id,
                attempt,
                fencing_token=fencing_token,
                values=values,
                output_tokens=partial_tokens,
                detail=detail,
            )

    def expire_claimed(self, item_id: int, attempt: int, reason: str) -> None:
        """reserved -> expired: the item cannot finish before its deadline, so it is not
        started at all (no prefill is spent on it)."""
        with self._db.transaction() as conn:
            move_item(
                conn, EXPIRE_CLAIMED, item_id, attempt, values={"error": reason}, detail=reason
            )

    def end_items(
        self, job_id: str, target: ItemState, *, only_unstarted: bool = False
    ) -> list[ActiveLeaseRow]:
        """Expire or cancel a job's unfinished items; returns the active ones it ended, so the
        caller can release their leases and abort their engine requests.

        ``only_unstarted``: only those no engine works on, the claimable and the held
        (``reserved``: a worker's commit then finds them gone and starts nothing), so a
        cancel does not wait for a hold to be committed or to lapse."""
        if target not in (ItemState.EXPIRED, ItemState.CANCELLED):
            raise IllegalTransition(f"end_items() moves to expired or cancelled, not {target}")
        unstarted = ITEM_CLAIMABLE | {ItemState.RESERVED}
        states = set(unstarted) if only_unstarted else set(ITEM_CLAIMABLE | ITEM_ACTIVE)
        sources = check_moves(sorted(states), target)
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(END_ITEMS),
                {"j": job_id, "src": sources, "to": target.value},
            ).all()
            bump_counters(conn, [(r.job_id, ItemState(r.from_state), target) for r in rows])
        return [active_row(r) for r in rows if ItemState(r.from_state) in ITEM_ACTIVE]

    def items(
        self,
        job_id: str,
        *,
        states: Iterable[ItemState] | None = None,
        after_line: int = -1,
        limit: int = 1000,
    ) -> list[ItemRecord]:
        """A page of a job's items in line order (results streaming, output files)."""
        state_list = [s.value for s in states] if states is not None else None
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(ITEMS_PAGE),
                {"j": job_id, "a": after_line, "s": state_list, "l": limit},
            ).all()
        return [
            ItemRecord(r[0], r[1], r[2], r[3], ItemState(r[4]), r[5], r[6], r[7], r[8], r[9])
            for r in rows
        ]
