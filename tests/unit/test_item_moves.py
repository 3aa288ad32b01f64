"""The guarded single-item move's decisions, without a database: which moves may be defined,
what the statement guards on, and what a refused move says."""

from __future__ import annotations

import pytest

from backfill.errors import IllegalTransition, StaleWrite
from backfill.states import ITEM_TRANSITIONS, AttemptOutcome, ItemState
from backfill.store import items
from backfill.store.moves import HELD_STATES, ItemMove

WORKER_MOVES = [
    items.PREEMPT,
    items.DEFER,
    items.RELEASE_UNSTARTED,
    items.FAIL_CLAIMED,
    items.FAIL_RUNNING,
    items.REQUEUE,
    items.EXPIRE_CLAIMED,
]


def test_a_move_outside_the_state_machine_cannot_be_defined() -> None:
    assert ItemState.SUCCEEDED not in ITEM_TRANSITIONS[ItemState.RESERVED]
    with pytest.raises(IllegalTransition):
        ItemMove(ItemState.RESERVED, ItemState.SUCCEEDED, AttemptOutcome.FAILED, "error = NULL")


def test_only_states_an_attempt_holds_are_sources() -> None:
    with pytest.raises(IllegalTransition, match="no attempt holds"):
        ItemMove(ItemState.QUEUED, ItemState.CANCELLED, AttemptOutcome.FAILED, "error = NULL")


@pytest.mark.parametrize("move", WORKER_MOVES, ids=lambda m: f"{m.source}->{m.target}")
def test_every_worker_move_guards_attempt_and_source(move: ItemMove) -> None:
    sql = move.statement
    assert move.source in HELD_STATES
    assert "WHERE id = :item AND attempt = :attempt" in sql
    assert f"state = '{move.source.value}'" in sql.split("WHERE", 1)[1]
    assert sql.startswith(f"UPDATE items SET state = '{move.target.value}', ")
    assert sql.endswith("RETURNING job_id")


@pytest.mark.parametrize("move", WORKER_MOVES, ids=lambda m: f"{m.source}->{m.target}")
def test_moves_out_of_running_name_the_fencing_token(move: ItemMove) -> None:
    fenced = "AND fencing_token = :fence" in move.statement
    assert fenced is (move.source is ItemState.RUNNING) is move.fenced


def test_a_fenced_move_without_a_token_is_refused_before_any_sql() -> None:
    with pytest.raises(ValueError, match="fencing token"):
        items.REQUEUE.params(7, 2, None, {})
    assert items.REQUEUE.params(7, 2, 99, {"retry": None}) == {
        "item": 7,
        "attempt": 2,
        "fence": 99,
        "retry": None,
    }


def test_a_refused_move_says_the_attempt_lost_the_item() -> None:
    claimed = items.EXPIRE_CLAIMED.refusal(7, 2)
    running = items.PREEMPT.refusal(7, 2)
    assert isinstance(claimed, StaleWrite)
    assert isinstance(running, StaleWrite)
    assert str(claimed) == "item 7 attempt 2 no longer holds its claim"
    assert str(running) == "item 7 attempt 2 is not running under it"


def test_give_back_moves_end_the_attempt_as_the_target_says() -> None:
    assert (items.DEFER.target, items.DEFER.outcome) == (
        ItemState.DEFERRED,
        AttemptOutcome.DEFERRED,
    )
    assert (items.RELEASE_UNSTARTED.target, items.RELEASE_UNSTARTED.outcome) == (
        ItemState.QUEUED,
        AttemptOutcome.RELEASED,
    )
