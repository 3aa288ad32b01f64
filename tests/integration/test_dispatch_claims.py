"""The dispatcher claims only what the node's slack can take: with leases held and less slack
left than one typical reservation, a claim could only be deferred at reserve time and requeued
(churn: Postgres writes, a retry delay on the item, and the next item waiting behind it), so
it waits for a lease to end instead.

Real Postgres and Redis; the engine is a stand-in that holds each stream a while, so the
slack stays full while the queue still holds work.
"""

from __future__ import annotations

from backfill.config import Settings
from backfill.states import ItemState
from backfill.store import Repository
from tests.integration import standin_engine as stand_in
from tests.integration.support_sql import query_rows

NODE = "n-claims"
BLOCK = 16
ITEMS = 24


def _submit(repo: Repository) -> str:
    # 5 prompt tokens + 100 out: 7 blocks each; the stand-in's 64 blocks hold a few at once.
    return stand_in.submit_completions(repo, "t-claims", ITEMS, 100)


def test_a_full_node_waits_for_a_lease_to_end_instead_of_claiming_into_deferral(
    settings: Settings,
) -> None:
    engine = stand_in.StandInEngine(hold_s=0.4)
    with stand_in.stand_in_node(settings, NODE, BLOCK) as (repo, _, aledger):
        job = _submit(repo)
        dispatcher = stand_in.quick_dispatcher(
            NODE, engine, repo, aledger, BLOCK, max_sequence_tokens=512
        )
        seen: list[int] = [0]
        stand_in.run_until(
            dispatcher,
            aledger,
            stand_in.all_succeeded(repo, job, ITEMS),
            polls=1200,
            each=lambda: seen.append(dispatcher.in_flight),
        )
        peak = max(seen)
        stats = dispatcher.stats
        assert repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == ITEMS, stats
        assert peak >= 2, "the node never held more than one lease: the test shows nothing"
        assert peak < ITEMS, "the slack held every item at once: the test shows nothing"
        assert stats.deferred == 0, stats
        # The first claim, before any reservation is typical, takes the whole queue and leaves
        # at once what the slack cannot hold; after that each claim is what fits.
        assert stats.claimed < 2 * ITEMS, stats
        # What a claim leaves costs nothing: no write, no attempt spent (a hold's commit gave
        # it back as a released attempt, each claim of it counting against max_attempts).
        attempts = query_rows(
            repo,
            "SELECT a.attempt, a.outcome FROM attempts a JOIN items i ON i.id = a.item_id "
            "WHERE i.job_id = :j",
            j=job,
        )
        assert sorted(attempts) == [(1, "succeeded")] * ITEMS, attempts
