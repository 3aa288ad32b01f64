"""The guarded move of one item held by one attempt: the one skeleton every single-item
transition of the worker's path shares.

A move is a value (:class:`ItemMove`): from which state to which, what else the row gets,
and how the attempt ends. Checked against ``backfill.states`` when it is defined. Its
statement guards on the attempt number, the source state and, once the item runs, the
ledger's fencing token, so a stale attempt's late write matches no row; :func:`move_item`
then raises :class:`~backfill.errors.StaleWrite` instead of writing, or, when the row moved,
ends the attempt's row and moves the job's counters in the same transaction.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Connection, text

from backfill.errors import IllegalTransition, StaleWrite
from backfill.states import ITEM_TRANSITIONS, AttemptOutcome, ItemState
from backfill.store.counters import bump_counters

# ``not_before`` from a delay in seconds (``:retry``, NULL: none), on Postgres' own clock: a
# worker's timestamp would carry its clock's error into every claim.
NOT_BEFORE = "now() + make_interval(secs => CAST(:retry AS float8))"

# Record how an attempt ended. An attempt's row exists once it started; one that ended
# unstarted (deferred, released, failed validation) is recorded here for the first time.
END_ATTEMPT = (
    "INSERT INTO attempts (item_id, attempt, node, ended_at, outcome, output_tokens, "
    "detail) SELECT id, attempt, coalesce(node, ''), now(), :o, :t, :d FROM items "
    "WHERE id = :i ON CONFLICT (item_id, attempt) DO UPDATE SET ended_at = now(), "
    "outcome = EXCLUDED.outcome, output_tokens = EXCLUDED.output_tokens, "
    "detail = EXCLUDED.detail"
)

HELD_STATES = (ItemState.RESERVED, ItemState.RUNNING)
"""The states an attempt holds an item in: the sources of a guarded move."""


T = TypeVar("T")


def in_id_order(rows: Sequence[T], item_id: Callable[[T], int]) -> list[T]:
    """``rows`` in item id order. Every statement that locks many items takes them in id
    order (the hot path's statements follow their arrays), so no two can wait on each other
    in a cycle: a deadlock Postgres would break after a second by aborting one of them."""
    return sorted(rows, key=item_id)


def check_moves(sources: Iterable[ItemState], target: ItemState) -> list[str]:
    """The sources' values, once every ``source -> target`` is in the state machine."""
    out = []
    for s in sources:
        if target not in ITEM_TRANSITIONS[s]:
            raise IllegalTransition(f"item {s} -> {target} is not in the state machine")
        out.append(s.value)
    return out


@dataclass(frozen=True)
class ItemMove:
    """One guarded move of one item held by one attempt.

    ``sets`` is what the row gets besides its new state (``updated_at`` is always set); its
    parameters come with the call. A move out of ``running`` names the fencing token the
    attempt started under; one out of ``reserved`` has none to name (a claim clears it).
    """

    source: ItemState
    target: ItemState
    outcome: AttemptOutcome
    sets: str

    def __post_init__(self) -> None:
        if self.source not in HELD_STATES:
            raise IllegalTransition(f"no attempt holds an item in {self.source}")
        check_moves([self.source], self.target)

    @property
    def fenced(self) -> bool:
        return self.source is ItemState.RUNNING

    @property
    def statement(self) -> str:
        """The guarded UPDATE: the row moves only while this attempt still holds it."""
        fence = " AND fencing_token = :fence" if self.fenced else ""
        return (
            f"UPDATE items SET state = '{self.target.value}', {self.sets}, updated_at = now() "
            f"WHERE id = :item AND attempt = :attempt AND state = '{self.source.value}'{fence} "
            "RETURNING job_id"
        )

    def params(
        self, item_id: int, attempt: int, fencing_token: int | None, values: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The statement's parameters; a fenced move without a token is a caller's bug."""
        if self.fenced and fencing_token is None:
            raise ValueError(f"{self.source} -> {self.target} needs the attempt's fencing token")
        return {"item": item_id, "attempt": attempt, "fence": fencing_token, **values}

    def refusal(self, item_id: int, attempt: int) -> StaleWrite:
        """What a move that matched no row says: the attempt no longer holds the item."""
        held = "is not running under it" if self.fenced else "no longer holds its claim"
        return StaleWrite(f"item {item_id} attempt {attempt} {held}")


def move_item(
    conn: Connection,
    move: ItemMove,
    item_id: int,
    attempt: int,
    *,
    fencing_token: int | None = None,
    values: Mapping[str, Any] | None = None,
    output_tokens: int | None = None,
    detail: str | None = None,
) -> None:
    """Carry ``move`` out in the caller's transaction: the guarded UPDATE, then the attempt's
    end and the counters; ``StaleWrite`` (nothing written) if the attempt lost the item."""
    params = move.params(item_id, attempt, fencing_token, values or {})
    row = conn.execute(text(move.statement), params).first()
    if row is None:
        raise move.refusal(item_id, attempt)
    end_attempt(conn, item_id, attempt, move.outcome, output_tokens, detail)
    bump_counters(conn, [(row[0], move.source, move.target)])


def end_attempt(
    conn: Connection,
    item_id: int,
    attempt: int,
    outcome: AttemptOutcome,
    output_tokens: int | None,
    detail: str | None = None,
) -> None:
    conn.execute(
        text(END_ATTEMPT),
        {"i": item_id, "a": attempt, "o": outcome.value, "t": output_tokens, "d": detail},
    )


def encode_partial(output: str | None) -> str | None:
    # Model output may hold any code point, NUL included, which a Postgres text column
    # refuses; stored as a JSON string it round-trips exactly.
    return None if output is None else json.dumps(output)


def decode_partial(stored: str | None) -> str | None:
    if stored is None:
        return None
    decoded = json.loads(stored)
    return decoded if isinstance(decoded, str) else None
