"""The harvest's match of a job's pending steps to the items read (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from backfill.store.summaries.outcomes import (
    FULL_READ_EVERY_S,
    WINDOW_SLACK_S,
    HarvestRead,
    harvest_read,
    match_ended,
)

BATCHES = {0: ("batch_a", "in_progress"), 1: ("batch_b", "failed"), 3: ("batch_d", "completed")}


def test_steps_whose_items_ended_in_seq_node_order() -> None:
    pending = [(2, 0, 0), (1, 1, 0), (1, 0, 0), (4, 0, 0)]
    items = [
        ("batch_a", 11, "1:0", "succeeded"),
        ("batch_a", 12, "1:1", "failed"),
        ("batch_a", 13, "2:0", "running"),  # not ended: left for a later round
        ("batch_b", 14, "1:0", "succeeded"),  # another batch's line of the same name
    ]
    found = match_ended(pending, BATCHES, items, 10)
    assert [(e.seq, e.node, e.item_id, e.item_state) for e in found] == [
        (1, 0, 11, "succeeded"),
        (1, 1, 12, "failed"),
    ]


def test_a_batch_that_ended_without_the_steps_item_ends_the_step_by_it() -> None:
    pending = [(5, 0, 1), (6, 0, 1), (7, 0, 3)]
    items = [("batch_b", 20, "6:0", "expired")]
    found = match_ended(pending, BATCHES, items, 10)
    assert [(e.seq, e.item_id, e.item_state, e.batch_state) for e in found] == [
        (5, None, None, "failed"),
        (6, 20, "expired", "failed"),
        (7, None, None, "completed"),
    ]


def test_steps_of_a_batch_numbered_but_not_made_wait() -> None:
    assert match_ended([(1, 0, 2)], BATCHES, [], 10) == []


def test_an_open_batch_without_the_item_yet_waits() -> None:
    assert match_ended([(1, 0, 0)], BATCHES, [], 10) == []


def test_at_most_limit_steps_the_first_in_order() -> None:
    pending = [(s, 0, 3) for s in range(10, 0, -1)]
    found = match_ended(pending, BATCHES, [], 3)
    assert [e.seq for e in found] == [1, 2, 3]


NOW = datetime(2026, 12, 7, 20, 0, tzinfo=UTC)


def test_a_round_reads_everything_until_a_round_has_and_every_minute_after() -> None:
    assert harvest_read(None, None, NOW) == HarvestRead(None, NOW)
    assert harvest_read(NOW, None, NOW).full
    stale = NOW - timedelta(seconds=FULL_READ_EVERY_S)
    assert harvest_read(NOW - timedelta(seconds=1), stale, NOW).full


def test_between_full_reads_a_round_reads_from_a_little_before_the_last_rounds_read() -> None:
    mark = NOW - timedelta(seconds=1)
    read = harvest_read(mark, NOW - timedelta(seconds=5), NOW)
    assert not read.full
    assert read.since == mark - timedelta(seconds=WINDOW_SLACK_S)
    assert read.at == NOW
