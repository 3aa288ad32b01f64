"""A node that looks for shared prompt prefixes leaves a new job's items in the queue until
the job's prefix pass has ended, for a bounded time (issue 36): claimed before it, they
reserved their whole prompts and ran as a wave of whole prompts (``bench.prefix``: 9 of 48
items, ~17 s of a 65 s run). A job no finder looks at, or whose pass failed, is claimed after
the bound, or at once.

Real Postgres and Redis; the engine is the prefix tests' stand-in (one word a token), whose
token ids take a while, as a busy engine's ``/tokenize`` does.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping
from typing import Any

from sqlalchemy import text

from backfill.config import Settings
from backfill.prefix_pass import FIRST_PAGE, find_job_prefixes
from backfill.states import ItemState
from backfill.store import Repository
from tests.integration.standin_engine import all_succeeded, run_until, stand_in_node
from tests.integration.test_dispatch_prefixes import (
    BLOCK,
    ITEMS,
    PrefillingEngine,
    _submit,
    prefix_dispatcher,
)
from worker.dispatch import DispatchConfig


class SlowIdsEngine(PrefillingEngine):
    """Token ids take ``ids_s`` each (or fail, with ``fail_ids``); when the last came back."""

    def __init__(self, *, ids_s: float, fail_ids: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ids_s, self.fail_ids = ids_s, fail_ids
        self.last_ids_at = 0.0
        self.ids_at: list[float] = []

    async def tokenize_ids(self, body: Mapping[str, Any], model: str) -> list[int]:
        await asyncio.sleep(self.ids_s)
        if self.fail_ids:
            raise RuntimeError("no token ids today")
        self.last_ids_at = time.monotonic()
        self.ids_at.append(self.last_ids_at)
        return await super().tokenize_ids(body, model)


def _leaned(repo: Repository, job: str) -> int:
    with repo.engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM items WHERE job_id = :j AND lease_prefix_tokens = 64"),
                {"j": job},
            ).scalar_one()
        )


def _run(
    settings: Settings,
    node: str,
    engine: SlowIdsEngine,
    *,
    hold_s: float,
    taken: bool = False,
) -> tuple[str, float, int]:
    """A fresh job run on a node that looks for prefixes (its finder and claims at once, as a
    worker's); ``taken``: a worker that died had taken the job for its prefixes. Returns the
    job, when it went in progress (monotonic, at most) and how many of its items leaned."""
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        ledger.register_pool(node, 64 * BLOCK, BLOCK)
        submitted = time.monotonic()
        job = _submit(repo, f"t-{node}")
        if taken:
            with repo.engine.begin() as conn:
                conn.execute(
                    text("UPDATE jobs SET prefixes_taken_at = now() WHERE id = :j"), {"j": job}
                )
        dispatcher = prefix_dispatcher(
            DispatchConfig(node=node, idle_poll_s=0.05, observe_interval_s=0.1,
                           prefix_caching=True, prefix_pass_hold_s=hold_s),
            engine,
            repo,
            aledger,
        )  # fmt: skip
        run_until(dispatcher, aledger, all_succeeded(repo, job, ITEMS), polls=2000)
        assert repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == ITEMS, dispatcher.stats
        assert dispatcher.stats.reservation_violations == 0, dispatcher.stats
        return job, submitted, _leaned(repo, job)


def test_a_fresh_jobs_items_wait_for_its_prefix_pass_then_lean_on_the_prefix(
    settings: Settings,
) -> None:
    """Red before: the claim took the job's first items while the pass was still asking for
    token ids, and they reserved their whole prompts. The pass's first page is recorded
    before its second is asked for, and claims take its items then; every item leans."""
    assert ITEMS > FIRST_PAGE  # two pages
    engine = SlowIdsEngine(ids_s=0.05, prefill_s=0.1, blocks=64, block=BLOCK, hold_s=0.15)
    _, _, leaned = _run(settings, "n-held", engine, hold_s=30.0)
    assert engine.started, "nothing ran"
    first_page_at = sorted(engine.ids_at)[FIRST_PAGE - 1]
    assert min(engine.started) >= first_page_at, (
        "an item reached the engine before the first page of the job's prefix pass",
        round(first_page_at - min(engine.started), 3),
    )
    assert leaned == ITEMS, leaned


def test_a_job_no_finder_looks_at_is_claimed_after_the_bound(settings: Settings) -> None:
    """Its pass was taken by a worker that died: nothing will end it."""
    engine = SlowIdsEngine(ids_s=0.0, prefill_s=0.0, blocks=64, block=BLOCK, hold_s=0.05)
    _, submitted, leaned = _run(settings, "n-orphan", engine, hold_s=1.0, taken=True)
    waited = min(engine.started) - submitted
    assert waited >= 1.0, waited
    assert leaned == 0


def test_a_job_whose_prefix_pass_failed_is_claimed_without_waiting_for_the_bound(
    settings: Settings,
) -> None:
    engine = SlowIdsEngine(
        ids_s=0.0, fail_ids=True, prefill_s=0.0, blocks=64, block=BLOCK, hold_s=0.05
    )
    _, submitted, leaned = _run(settings, "n-failed", engine, hold_s=30.0)
    assert min(engine.started) - submitted < 15.0
    assert leaned == 0


def test_the_claim_leaves_a_fresh_job_only_where_the_node_holds_for_prefixes(
    settings: Settings,
) -> None:
    """The store's side: the claim's filter, on the job's row the claim reads already."""
    with stand_in_node(settings, "n-claim", BLOCK) as (repo, _, _):
        job = _submit(repo, "t-claim")

        def claimed(hold_s: float | None) -> int:
            claim = repo.claims.open_claim("n-claim", 4, 30.0, models=["m"], prefix_hold_s=hold_s)
            n = len(claim.items)
            if claim.open:
                repo.claims.drop_claim(claim)
            return n

        assert claimed(30.0) == 0
        assert claimed(None) == 4
        repo.prefixes.record_prefixes(job, [])  # the pass ended, finding nothing
        assert claimed(30.0) == 4
        with repo.engine.begin() as conn:
            conn.execute(
                text(
                    "UPDATE jobs SET prefixes_ended_at = NULL, "
                    "in_progress_at = now() - interval '1 minute' WHERE id = :j"
                ),
                {"j": job},
            )
        assert claimed(30.0) == 4  # past the bound


def test_a_job_of_one_item_is_neither_held_nor_looked_at(settings: Settings) -> None:
    """One item shares a prefix with no other item of its job: its pass would cost an engine
    call and a write, and hold the item for both, for nothing (a summarisation job's last
    reduce steps come as batches of one; red before: held, and taken)."""
    with stand_in_node(settings, "n-one", BLOCK) as (repo, _, _):
        job = _submit(repo, "t-one", count=1)
        claim = repo.claims.open_claim("n-one", 4, 30.0, models=["m"], prefix_hold_s=30.0)
        assert [item.job_id for item in claim.items] == [job]
        repo.claims.drop_claim(claim)
        taken = repo.prefixes.take_prefix_job(["m"])
        assert taken is None or taken.job_id != job


class CountingIdsEngine(SlowIdsEngine):
    """Records how many token-id requests were in flight at once, at most."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.in_flight = self.most_at_once = 0

    async def tokenize_ids(self, body: Mapping[str, Any], model: str) -> list[int]:
        self.in_flight += 1
        self.most_at_once = max(self.most_at_once, self.in_flight)
        try:
            return await super().tokenize_ids(body, model)
        finally:
            self.in_flight -= 1


def test_the_prefix_pass_asks_for_several_items_token_ids_at_once(settings: Settings) -> None:
    """The job waits for its pass, so the pass must not ask one prompt at a time (red before:
    one at a time, 48 prompts took seconds on a busy CPU engine); the same grouping comes out."""
    engine = CountingIdsEngine(ids_s=0.02, prefill_s=0.0, blocks=64, block=BLOCK)
    with stand_in_node(settings, "n-pass", BLOCK) as (repo, _, _):
        job = _submit(repo, "t-pass")
        found = asyncio.run(
            find_job_prefixes(
                engine,
                repo.prefixes,
                job,
                endpoint="/v1/completions",
                model="m",
                tenant_id="t-pass",
                block_size=BLOCK,
                concurrency=4,
            )
        )
        assert (found.looked_at, found.grouped, found.groups) == (ITEMS, ITEMS, 1)
        [group] = repo.prefixes.prefix_groups(job)
        assert (group.blocks, group.items) == (4, ITEMS)
    assert engine.most_at_once == 4


class GatedIdsEngine(PrefillingEngine):
    """Token ids of the items past the first ``first_page`` wait for ``gate``; ``past_first``
    is set when the first of them is asked for (the pass has moved on to its next page)."""

    def __init__(self, first_page: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.first_page = first_page
        self.gate = asyncio.Event()
        self.past_first = asyncio.Event()

    async def tokenize_ids(self, body: Mapping[str, Any], model: str) -> list[int]:
        doc = re.search(r"doc(\d+)", str(body["prompt"]))
        assert doc is not None
        if int(doc.group(1)) >= self.first_page:
            self.past_first.set()
            await self.gate.wait()
        return await super().tokenize_ids(body, model)


def _pass_with_a_gate(
    settings: Settings, node: str, first_page: int, claim: int, **pages: int
) -> tuple[int, int, int, list[tuple[int, int]]]:
    """A pass over ``3 * first_page`` items whose token ids past the first ``first_page``
    wait: what was recorded and how many of ``claim`` items a claim took while they waited,
    what the pass recorded in all, and the job's groups after (blocks, items) (``pages``: its
    page sizes, when not the defaults)."""
    engine = GatedIdsEngine(first_page, prefill_s=0.0, blocks=64, block=BLOCK)
    with stand_in_node(settings, node, BLOCK) as (repo, _, _):
        job = _submit(repo, f"t-{node}", count=3 * first_page)

        def recorded() -> int:
            return sum(group.items for group in repo.prefixes.prefix_groups(job))

        def claimed() -> int:
            taken = repo.claims.open_claim(node, claim, 30.0, models=["m"], prefix_hold_s=30.0)
            if taken.open:
                repo.claims.drop_claim(taken)
            return len(taken.items)

        async def scenario() -> tuple[int, int, int]:
            finding = asyncio.create_task(
                find_job_prefixes(
                    engine,
                    repo.prefixes,
                    job,
                    endpoint="/v1/completions",
                    model="m",
                    tenant_id=f"t-{node}",
                    block_size=BLOCK,
                    **pages,
                )
            )
            await asyncio.wait_for(engine.past_first.wait(), 120)
            during = await asyncio.to_thread(recorded), await asyncio.to_thread(claimed)
            engine.gate.set()
            found = await finding
            return *during, found.recorded

        during = asyncio.run(scenario())
        groups = [(g.blocks, g.items) for g in repo.prefixes.prefix_groups(job)]
        return (*during, groups)


def test_a_big_batchs_claims_take_the_items_its_prefix_pass_has_recorded_as_it_goes(
    settings: Settings,
) -> None:
    """The pass records what each page grouped as the page ends, and claims take the items
    it has recorded: a batch of 50,000 items is claimed after its first page's token ids, not
    its last, and never past the pass (red before: the first record ended the hold on the
    whole job, and a claim took items the pass had not reached, to reserve whole prompts)."""
    page = 8
    recorded_during, claimed_during, recorded_in_all, groups = _pass_with_a_gate(
        settings, "n-pages", page, claim=page + 4, page=page
    )
    assert recorded_during == page  # the first page's items, while the rest wait
    assert claimed_during == page  # those, not the 4 past the pass
    assert recorded_in_all == 3 * page
    assert groups == [(4, 3 * page)]  # one group: the pages agree


def test_the_prefix_passs_first_page_is_small_so_a_jobs_first_claims_come_soon(
    settings: Settings,
) -> None:
    """At default page sizes the pass records its first ``FIRST_PAGE`` items before it asks
    for more (red before: its first page was ``PAGE`` items, so a job of fewer waited for all
    of its token ids before any item was claimable)."""
    recorded_during, claimed_during, recorded_in_all, _ = _pass_with_a_gate(
        settings, "n-first", FIRST_PAGE, claim=64
    )
    assert recorded_during == FIRST_PAGE
    assert claimed_during == FIRST_PAGE
    assert recorded_in_all == 3 * FIRST_PAGE


def test_a_nodes_claim_loop_takes_a_recorded_page_without_waiting_for_the_pass_to_end(
    settings: Settings,
) -> None:
    """The pass wakes its node's claim loop as each page is recorded (red before: woken only
    at the pass's end, the idle loop slept its poll out while the first page's items were
    claimable, and nothing ran while the rest of the pass waited)."""
    node = "n-paged"
    engine = GatedIdsEngine(FIRST_PAGE, prefill_s=0.0, blocks=64, block=BLOCK)
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        ledger.register_pool(node, 64 * BLOCK, BLOCK)
        _submit(repo, f"t-{node}", count=3 * FIRST_PAGE)
        dispatcher = prefix_dispatcher(
            DispatchConfig(node=node, idle_poll_s=30.0, observe_interval_s=0,
                           prefix_caching=True, prefix_pass_hold_s=30.0),
            engine,
            repo,
            aledger,
        )  # fmt: skip

        async def main() -> int:
            runner = asyncio.create_task(dispatcher.run())
            try:
                await asyncio.wait_for(engine.past_first.wait(), 60)
                for _ in range(200):  # 10 s at most; the poll is 30 s
                    if engine.started:
                        break
                    await asyncio.sleep(0.05)
                return len(engine.started)
            finally:
                engine.gate.set()
                dispatcher.stop()
                await asyncio.wait({runner}, timeout=30)
                await aledger.aclose()

        started_while_the_pass_waited = asyncio.run(main())
    assert started_while_the_pass_waited > 0, "no item of the recorded first page ran"
