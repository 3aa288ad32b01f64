"""A node's dispatcher reserves a shared prompt prefix once (issue 36): it finds a job's
prefixes through its engine's token ids, the first item of a prefix pays for it, the others
join once it is cached (prefilled), and the slack holds more items at once than when each
reserves its whole prompt. Postgres records what of each lease is the prefix, so a ledger
rebuilt from it holds the prefix again.

Real Postgres and Redis; the engine is a stand-in that tokenizes a prompt one word a token
and holds each stream a while, so leases overlap.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from sqlalchemy import text

from backfill.config import Settings
from backfill.engine.protocol import ChoiceDelta, CompletionStream, StreamChunk, Usage
from backfill.ledger import AsyncLedger
from backfill.maintenance import ensure_ledger
from backfill.states import ItemState
from backfill.store import NewItem, Repository
from tests.integration.standin_engine import (
    StandInEngine,
    _in_progress_job,
    all_succeeded,
    run_until,
    stand_in_dispatcher,
    stand_in_node,
)
from worker.dispatch import DispatchConfig, NodeDispatcher

BLOCK = 16
ITEMS = 24
INSTRUCTION = " ".join(f"rule{i}" for i in range(64))  # 64 tokens: four whole blocks
OUT = 40


class WordEngine(StandInEngine):
    """A stand-in with prefix caching that counts and tokenizes a prompt one word a token."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.vocab: dict[str, int] = {}

    def ids(self, prompt: str) -> list[int]:
        return [self.vocab.setdefault(w, len(self.vocab) + 1) for w in prompt.split()]

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        return len(self.ids(str(body["prompt"])))

    async def tokenize_ids(self, body: Mapping[str, Any], model: str) -> list[int]:
        return self.ids(str(body["prompt"]))

    def answer(self, body: Mapping[str, Any]) -> CompletionStream:
        """Prefill at once, then decode for ``hold_s``: as a real engine spends most of an
        item's time decoding, with its prompt (and the prefix) cached from its first token."""
        prompt = len(self.ids(str(body["prompt"])))
        # Items end at different times, as documents of different lengths do.
        hold_s = self.hold_s * (1 + len(self.streamed) % 4)

        async def chunks() -> AsyncIterator[StreamChunk]:
            yield StreamChunk("c", (ChoiceDelta(0, "ok", None),), None, {})
            await asyncio.sleep(hold_s)
            yield StreamChunk("c", (ChoiceDelta(0, "", "stop"),), None, {})
            yield StreamChunk("c", (), Usage(prompt, 1, prompt + 1), {})

        return CompletionStream(chunks())


class PrefillingEngine(WordEngine):
    """A :class:`WordEngine` whose prefill takes ``prefill_s`` (its first token comes that
    long after the stream starts), as a 1,000-token prompt does on a CPU engine; it records
    when each stream started and when it sent its first token."""

    def __init__(self, *, prefill_s: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prefill_s = prefill_s
        self.started: list[float] = []
        self.first_tokens: list[float] = []

    def answer(self, body: Mapping[str, Any]) -> CompletionStream:
        self.started.append(time.monotonic())
        inner = super().answer(body)

        async def chunks() -> AsyncIterator[StreamChunk]:
            await asyncio.sleep(self.prefill_s)
            first = True
            async with inner:
                async for chunk in inner:
                    if first:
                        self.first_tokens.append(time.monotonic())
                        first = False
                    yield chunk

        return CompletionStream(chunks())


def prefix_dispatcher(
    config: DispatchConfig, engine: WordEngine, repo: Repository, ledger: AsyncLedger
) -> NodeDispatcher:
    """A stand-in node's dispatcher (context 512) whose prefix finder looks in ``repo``."""
    dispatcher = stand_in_dispatcher(config, engine, repo, ledger, BLOCK, max_sequence_tokens=512)
    dispatcher.prefix_jobs = repo.prefixes
    return dispatcher


def _submit(repo: Repository, tenant: str, count: int = ITEMS) -> str:
    items = [
        NewItem(
            i,
            f"r{i}",
            json.dumps(
                {"model": "m", "prompt": f"{INSTRUCTION} doc{i} a b c d e f", "max_tokens": OUT}
            ),
            OUT,
        )
        for i in range(count)
    ]
    job = _in_progress_job(repo, tenant, "/v1/completions", items)
    with repo.engine.begin() as conn:  # the API records the model its lines name
        conn.execute(text("UPDATE jobs SET model = 'm' WHERE id = :j"), {"j": job})
    return job


def _run(
    settings: Settings, node: str, *, prefixes: bool, engine: WordEngine | None = None
) -> tuple[str, int, int, Any]:
    engine = engine or WordEngine(blocks=64, block=BLOCK, hold_s=0.15)
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        # A second node of one test: the ledger is built already, the node joins it as a
        # worker's node does.
        ledger.register_pool(node, 64 * BLOCK, BLOCK)
        job = _submit(repo, f"t-{node}")
        dispatcher = prefix_dispatcher(
            DispatchConfig(node=node, idle_poll_s=0.05, observe_interval_s=0.1,
                           prefix_caching=prefixes),
            engine,
            repo,
            aledger,
        )  # fmt: skip
        if prefixes:

            async def find() -> None:
                finder = asyncio.create_task(dispatcher.prefixes.find_prefixes())
                for _ in range(200):  # the pass records a page at a time: until its last
                    if sum(g.items for g in repo.prefixes.prefix_groups(job)) == ITEMS:
                        break
                    await asyncio.sleep(0.05)
                finder.cancel()

            asyncio.run(find())
            [group] = repo.prefixes.prefix_groups(job)
            assert (group.blocks, group.items) == (4, ITEMS)
        seen = [0]
        run_until(
            dispatcher,
            aledger,
            all_succeeded(repo, job, ITEMS),
            polls=2000,
            each=lambda: seen.append(dispatcher.in_flight),
        )
        assert repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == ITEMS, dispatcher.stats
        stats = dispatcher.stats
        assert stats.reservation_violations == 0, stats
        assert stats.over_reserved_samples == 0, stats
        with repo.engine.connect() as conn:
            leaned = conn.execute(
                text("SELECT count(*) FROM items WHERE job_id = :j AND lease_prefix_tokens = 64"),
                {"j": job},
            ).scalar_one()
        return job, max(seen), leaned, stats


def test_items_of_a_shared_instruction_run_more_at_once_when_it_is_reserved_once(
    settings: Settings,
) -> None:
    _, today, leaned_today, _ = _run(settings, "n-whole", prefixes=False)
    _, shared, leaned, stats = _run(settings, "n-shared", prefixes=True)
    print(f"peak in flight: {today} whole, {shared} shared; {leaned} leaned; {stats}")
    assert leaned_today == 0
    assert leaned >= ITEMS // 2, "few items leaned on the prefix: the test shows nothing"
    # 104 prompt + output tokens a whole reservation: 7 blocks; its own past the prefix: 3.
    assert shared >= 2 * today, (shared, today)


def test_a_prefix_group_reaches_the_engine_only_once_its_first_holder_has_prefilled(
    settings: Settings,
) -> None:
    """Its first holder starts alone; the rest of the group, claimed meanwhile, waits in the
    queue and leans on the prefix once the first token is back (red before: they started
    beside it, reserving their whole prompts)."""
    engine = PrefillingEngine(prefill_s=0.3, blocks=64, block=BLOCK, hold_s=0.15)
    _, _, leaned, stats = _run(settings, "n-first", prefixes=True, engine=engine)
    assert leaned == ITEMS, (leaned, stats)
    assert stats.prefix_waits > 0, stats
    first_token = engine.first_tokens[0]
    assert all(t >= first_token for t in engine.started[1:]), (
        "an item of the group reached the engine before its first holder had prefilled",
        [round(t - first_token, 3) for t in engine.started],
    )


def test_a_rebuilt_ledger_holds_a_running_items_prefix_again(settings: Settings) -> None:
    node = "n-rebuild"
    with stand_in_node(settings, node, BLOCK) as (repo, ledger, aledger):
        job = _submit(repo, "t-rebuild")
        prefix = "f" * 32
        with repo.engine.begin() as conn:
            ids = (
                conn.execute(
                    text("SELECT id FROM items WHERE job_id = :j ORDER BY id LIMIT 2"), {"j": job}
                )
                .scalars()
                .all()
            )
            for at, item_id in enumerate(ids):
                conn.execute(
                    text(
                        "UPDATE items SET state = 'running', node = :n, attempt = 1, "
                        "lease_id = :l, fencing_token = :f, reservation_tokens = 48, "
                        "lease_expires_at = now() + interval '1 minute', prefix_id = :p, "
                        "prefix_blocks = 4, lease_prefix_tokens = 64 WHERE id = :i"
                    ),
                    {"n": node, "l": f"ls_r{at}", "f": at + 1, "p": prefix, "i": item_id},
                )
        for key in ledger.client.scan_iter(match=f"{settings.redis_namespace}:*"):
            ledger.client.delete(key)
        ensure_ledger(repo, ledger, max_preemptions=3)
        snap = ledger.snapshot(node)
        assert snap is not None
        assert [(p.prefix_id, p.tokens, p.holders) for p in snap.prefixes] == [(prefix, 64, 2)]
        assert snap.batch_in_use == 2 * 48 + 64
        asyncio.run(aledger.aclose())
