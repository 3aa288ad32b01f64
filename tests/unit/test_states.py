"""The state machine: one table, terminal states final, every state reachable."""

from __future__ import annotations

from collections import deque

import pytest

from backfill.states import (
    FINISH_REASON_STATE,
    ITEM_ACTIVE,
    ITEM_CLAIMABLE,
    ITEM_TERMINAL,
    ITEM_TRANSITIONS,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    ItemState,
    JobState,
    can_item_move,
    can_job_move,
    item_sources,
    job_sources,
)


def _reachable(table: dict[ItemState, frozenset[ItemState]], start: ItemState) -> set[ItemState]:
    seen = {start}
    todo = deque([start])
    while todo:
        for nxt in table[todo.popleft()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_every_item_state_has_a_row_in_the_table() -> None:
    assert set(ITEM_TRANSITIONS) == set(ItemState)
    assert set(JOB_TRANSITIONS) == set(JobState)


def test_terminal_item_states_have_no_way_out() -> None:
    for state in ITEM_TERMINAL:
        assert ITEM_TRANSITIONS[state] == frozenset()
    for state in set(ItemState) - ITEM_TERMINAL:
        assert ITEM_TRANSITIONS[state], f"{state} is a dead end but not terminal"


def test_terminal_job_states_have_no_way_out() -> None:
    for state in JOB_TERMINAL:
        assert JOB_TRANSITIONS[state] == frozenset()
    for state in set(JobState) - JOB_TERMINAL:
        assert JOB_TRANSITIONS[state]


def test_every_item_state_is_reachable_from_queued() -> None:
    assert _reachable(ITEM_TRANSITIONS, ItemState.QUEUED) == set(ItemState)


def test_every_nonterminal_item_state_can_still_finish() -> None:
    for state in set(ItemState) - ITEM_TERMINAL:
        assert _reachable(ITEM_TRANSITIONS, state) & ITEM_TERMINAL


def test_engine_work_only_starts_from_a_claim() -> None:
    # Running is entered from a claim only: a hold (reserved) or, in the worker's open claim,
    # straight from a claimable state in the transaction that holds the item locked; either
    # way the start writes the ledger lease that covers it (tests/integration/test_open_claims).
    # Nothing finished or in flight elsewhere ever becomes running again.
    assert item_sources(ItemState.RUNNING) == {ItemState.RESERVED} | ITEM_CLAIMABLE
    assert item_sources(ItemState.RESERVED) == ITEM_CLAIMABLE


def test_success_only_from_running() -> None:
    assert item_sources(ItemState.SUCCEEDED) == {ItemState.RUNNING}


def test_preempted_items_are_claimable_again_and_keep_their_way_to_expiry() -> None:
    assert ItemState.PREEMPTED in ITEM_CLAIMABLE
    assert can_item_move(ItemState.PREEMPTED, ItemState.EXPIRED)
    assert not can_item_move(ItemState.PREEMPTED, ItemState.SUCCEEDED)


def test_claimable_active_and_terminal_partition_the_states() -> None:
    assert set(ItemState) == ITEM_CLAIMABLE | ITEM_ACTIVE | ITEM_TERMINAL
    assert not ITEM_CLAIMABLE & ITEM_ACTIVE
    assert not ITEM_ACTIVE & ITEM_TERMINAL
    assert not ITEM_CLAIMABLE & ITEM_TERMINAL


@pytest.mark.parametrize("state", sorted(ITEM_TERMINAL))
def test_nothing_leaves_a_terminal_item(state: ItemState) -> None:
    for target in ItemState:
        assert not can_item_move(state, target)


def test_job_reaches_completed_only_through_finalizing() -> None:
    assert job_sources(JobState.COMPLETED) == {JobState.FINALIZING}
    assert job_sources(JobState.CANCELLED) >= {JobState.CANCELLING}
    assert not can_job_move(JobState.COMPLETED, JobState.IN_PROGRESS)


def test_engine_finish_reasons_map_to_item_states() -> None:
    assert FINISH_REASON_STATE["stop"] is ItemState.SUCCEEDED
    assert FINISH_REASON_STATE["length"] is ItemState.SUCCEEDED
    assert FINISH_REASON_STATE["abort"] is ItemState.PREEMPTED
    assert FINISH_REASON_STATE["error"] is ItemState.FAILED
