"""The gateway's interactive activity as the work budget reads it: counted per node from
arrival to first token, summed over gateway processes, stale entries ignored."""

from __future__ import annotations

import json

from backfill.config import Settings
from backfill.work_budget import BudgetReason, WorkBudget
from backfill.work_signals import (
    BudgetView,
    InteractiveActivity,
    InteractiveSignals,
    fresh_budgets,
    merge_batch_awaiting,
    merge_budgets,
    merge_signals,
    work_budget_policy,
)
from tests.unit.support_clock import HandClock


def test_a_request_waits_on_every_candidate_node_then_prefills_on_one() -> None:
    clock = HandClock(1000.0)
    activity = InteractiveActivity(clock=clock)
    req = activity.arrived(["a", "b"])
    snap = activity.snapshot(keep_s=3.0)
    assert snap["a"].waiting == snap["b"].waiting == 1
    assert snap["a"].oldest_pending_since_s == 1000.0
    req.admitted("b")
    snap = activity.snapshot(keep_s=3.0)
    assert (snap["a"].waiting, snap["a"].prefilling) == (0, 0)
    assert (snap["b"].waiting, snap["b"].prefilling) == (0, 1)
    clock.now = 1000.4
    req.first_token(0.4)
    snap = activity.snapshot(keep_s=3.0)
    assert snap["b"].prefilling == 0
    assert snap["b"].oldest_pending_since_s is None
    assert snap["b"].ttfts == ((1000.4, 0.4),)
    req.end()  # after the first token: nothing more to count
    clock.now = 1020.0
    assert activity.snapshot(keep_s=3.0) == {}, "idle nodes and old TTFTs drop out"


def test_a_refused_request_stops_counting() -> None:
    activity = InteractiveActivity(clock=HandClock(1000.0))
    req = activity.arrived(["a"])
    before = activity.version
    req.end()
    assert activity.version > before
    assert activity.snapshot(keep_s=3.0)["a"].waiting == 0


def test_merge_sums_fresh_gateways_and_drops_stale_or_malformed_ones() -> None:
    fresh = InteractiveSignals(2, 1, 99.0, ((98.0, 0.3),)).to_json(100.0)
    other = InteractiveSignals(1, 0, 97.5, ((99.0, 0.9),)).to_json(99.5)
    stale = InteractiveSignals(50, 50, 1.0, ()).to_json(90.0)
    merged = merge_signals(
        {b"g1": fresh.encode(), "g2": other, "g3": stale, "g4": "not json"}, 100.5, 3.0
    )
    assert (merged.waiting, merged.prefilling) == (3, 1)
    assert merged.oldest_pending_since_s == 97.5
    assert merged.ttfts == ((98.0, 0.3), (99.0, 0.9))


def test_other_workers_batch_awaiting_sums_fresh_entries_but_not_its_own() -> None:
    raw = {
        b"me": b'{"a": 5, "at": 100.0}',
        b"w2": b'{"a": 3, "at": 100.2}',
        "w3": '{"a": 4, "at": 99.9}',
        "dead": '{"a": 40, "at": 90.0}',
        "bad": "{}",
        "neg": '{"a": -2, "at": 100.0}',
    }
    assert merge_batch_awaiting(raw, "me", 100.5, 1.0) == 7
    assert merge_batch_awaiting({}, "me", 100.5, 1.0) == 0


def test_budget_view_round_trips_through_a_hash() -> None:
    b = WorkBudget(
        8, 1024, hold=True, code=BudgetReason.INTERACTIVE_WAITING, reason="r", changed_at_s=5.0
    )
    view = BudgetView.of(b, 3, 700, 6.0)
    raw = {k.encode(): v.encode() for k, v in view.to_mapping().items()}
    assert BudgetView.from_mapping(raw) == view
    assert BudgetView.from_mapping({b"max_seqs": b"x"}) is None


def _entry(view: BudgetView, expires: float) -> str:
    return json.dumps(view.to_mapping() | {"expires": repr(expires)})


def test_a_nodes_budget_sums_its_workers_fresh_entries() -> None:
    """Two workers on one node each run a budget against the same engine: the node's limits and
    use are their sums, it holds batch when either holds, and says the latest change; a dead
    worker's entry (past its expiry) and unreadable entries do not count."""
    quiet = WorkBudget(
        16, 4096, hold=False, code=BudgetReason.QUIET, reason="quiet", changed_at_s=50.0
    )
    held = WorkBudget(
        2,
        512,
        hold=True,
        code=BudgetReason.INTERACTIVE_WAITING,
        reason="2 interactive waiting",
        changed_at_s=99.0,
    )
    raw = {
        b"w1": _entry(BudgetView.of(quiet, 10, 900, 100.0), 105.0).encode(),
        b"w2": _entry(BudgetView.of(held, 2, 300, 100.1), 105.1).encode(),
        b"dead": _entry(BudgetView.of(quiet, 50, 9000, 90.0), 95.0).encode(),
        b"junk": b"{not json",
        b"partial": b'{"expires": "200", "max_seqs": "x"}',
    }
    views = fresh_budgets(raw, now_s=100.5)
    assert len(views) == 2
    node = merge_budgets(views)
    assert node is not None
    assert (node.max_seqs, node.max_prefill_tokens, node.in_flight, node.prefill_tokens) == (
        18,
        4608,
        12,
        1200,
    )
    assert node.hold
    assert node.code == str(BudgetReason.INTERACTIVE_WAITING)
    assert (node.changed_at_s, node.at_s, node.workers) == (99.0, 100.1, 2)
    assert merge_budgets(fresh_budgets(raw, now_s=106.0)) is None
    assert merge_budgets([]) is None


def test_policy_from_settings_caps_the_ceiling_at_the_in_flight_limit() -> None:
    s = Settings(
        work_budget_ceiling_seqs=128, work_budget_floor_seqs=4, interactive_ttft_target_s=0.5
    )
    policy = work_budget_policy(s, max_in_flight=32)
    assert (policy.floor_seqs, policy.ceiling_seqs, policy.ttft_target_s) == (4, 32, 0.5)
    assert work_budget_policy(s, max_in_flight=2).floor_seqs == 2
