"""An engine stand-in for dispatcher tests over real Postgres and Redis, where the engine's
output is not what is tested: every prompt counts 5 tokens, every request answers one token
at once, and the engine makes progress at every load read (the stall watch stays quiet).
``fail_after`` makes every stream raise an error of the worker's own (not an engine error)
after that many chunks: a fault no real engine can be made to produce. ``hold_s`` keeps each
stream open that long before its answer, so that leases stay held while others are claimed."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

from sqlalchemy import text

from backfill.config import Settings
from backfill.dispatch import DispatchConfig
from backfill.engine.protocol import (
    ChoiceDelta,
    CompletionStream,
    Engine,
    ModelInfo,
    StreamChunk,
    Usage,
)
from backfill.engine_metrics import EngineLoad, EnginePool
from backfill.ledger import AsyncLedger, Lease, Ledger, PoolSnapshot
from backfill.maintenance import ensure_ledger, pool_policy
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository
from worker.dispatch import NodeDispatcher


def _in_progress_job(repo: Repository, tenant: str, endpoint: str, items: list[NewItem]) -> str:
    record = repo.tenants.create_tenant(tenant)
    f = repo.files.create_file(record.id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        record.id, f.id, endpoint, "1h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(job.id, items)
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    return job.id


def submit_completions(repo: Repository, tenant: str, items: int, max_tokens: int) -> str:
    """An in-progress job of ``items`` one-word completions for the stand-in's model ``m``
    (5 prompt tokens each), each declaring ``max_tokens``; returns its id."""
    body = json.dumps({"model": "m", "prompt": "x", "max_tokens": max_tokens})
    return _in_progress_job(
        repo,
        tenant,
        "/v1/completions",
        [NewItem(i, f"r{i}", body, max_tokens) for i in range(items)],
    )


def submit_one(
    repo: Repository,
    tenant: str,
    endpoint: str,
    custom_id: str,
    body: dict[str, Any],
    max_output_tokens: int,
) -> str:
    """An in-progress job of one item, ``body`` for ``endpoint``; returns its id."""
    return _in_progress_job(
        repo, tenant, endpoint, [NewItem(0, custom_id, json.dumps(body), max_output_tokens)]
    )


def only_item(repo: Repository, job_id: str) -> dict[str, Any]:
    """The job's one item as stored: its state, attempt, preemptions, tokens, partial output
    and result."""
    with repo.engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT state, attempt, preemptions, reservation_tokens, prompt_tokens, "
                "output_tokens, partial_output, partial_tokens, result FROM items "
                "WHERE job_id = :j"
            ),
            {"j": job_id},
        ).one()
    return dict(row._mapping)


class StandInEngine:
    def __init__(
        self,
        *,
        blocks: int = 64,
        block: int = 16,
        fail_after: int | None = None,
        hold_s: float = 0.0,
    ):
        self.blocks, self.block = blocks, block
        self.fail_after = fail_after
        self.hold_s = hold_s
        self.streamed: list[str] = []
        """Request ids, one per stream started."""
        self._progress = 0

    async def pool(self) -> EnginePool:
        return EnginePool(
            num_blocks=self.blocks, block_size=self.block, capacity_tokens=self.blocks * self.block
        )

    async def load(self) -> EngineLoad:
        self._progress += 1
        return EngineLoad(0.0, 0, 0, 0, 0, self._progress)

    async def models(self) -> list[ModelInfo]:
        return [ModelInfo("m", 512, None)]

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        return 5

    def stream_completion(
        self,
        endpoint: str,
        body: Mapping[str, Any],
        *,
        priority: int,
        request_id: str,
        stream_interval: int = 1,
    ) -> CompletionStream:
        """Records ``request_id`` in :attr:`streamed`, then streams :meth:`answer`."""
        self.streamed.append(request_id)
        return self.answer(body)

    def answer(self, body: Mapping[str, Any]) -> CompletionStream:
        """The stream for a request of ``body``: what a subclass overrides to answer its own
        way (its request id already recorded)."""
        fail_after, hold_s = self.fail_after, self.hold_s

        async def chunks() -> AsyncIterator[StreamChunk]:
            if hold_s:
                await asyncio.sleep(hold_s)
            answer = [
                StreamChunk("c", (ChoiceDelta(0, "ok", "stop"),), None, {}),
                StreamChunk("c", (), Usage(5, 1, 6), {}),
            ]
            for sent, chunk in enumerate(answer):
                if sent == fail_after:
                    raise RuntimeError("a fault of the worker's own")
                yield chunk

        return CompletionStream(chunks())


def stand_in_dispatcher(
    config: DispatchConfig,
    engine: object,
    repo: Repository,
    ledger: AsyncLedger,
    block: int,
    max_sequence_tokens: int = 1024,
) -> NodeDispatcher:
    """A node's dispatcher over a stand-in ``engine`` serving model ``m`` (context 1,024
    unless told)."""
    return NodeDispatcher(
        config,
        cast(Engine, engine),
        repo,
        ledger,
        model="m",
        block_size=block,
        max_sequence_tokens=max_sequence_tokens,
    )


def quick_dispatcher(
    node: str, engine: object, repo: Repository, ledger: AsyncLedger, block: int, **config: Any
) -> NodeDispatcher:
    """:func:`stand_in_dispatcher` for ``node``, polling every 0.05 s when idle and reading
    the engine's load only when it needs it (``observe_interval_s=0``) unless ``config`` says
    otherwise; ``config`` is the rest of its :class:`DispatchConfig`, and may name the
    engine's context, ``max_sequence_tokens`` (1,024 unless told)."""
    context = int(config.pop("max_sequence_tokens", 1024))
    fields = {"idle_poll_s": 0.05, "observe_interval_s": 0, **config}
    return stand_in_dispatcher(
        DispatchConfig(node=node, **fields), engine, repo, ledger, block, context
    )


def all_succeeded(repo: Repository, job: str, items: int) -> Callable[[], bool]:
    """A ``done`` for :func:`run_until`: ``items`` of ``job``'s items have succeeded."""
    return lambda: repo.stats.counted_states(job).get(ItemState.SUCCEEDED) == items


def run_until(
    dispatcher: NodeDispatcher,
    ledger: AsyncLedger,
    done: Callable[[], bool],
    *,
    polls: int = 400,
    each: Callable[[], None] | None = None,
    linger_s: float = 0.0,
    before_stop: Callable[[], None] | None = None,
) -> None:
    """Run ``dispatcher`` on an event loop of its own until ``done()``, checked every 0.05 s
    (at most ``polls`` times; ``each()`` runs at every check); then, ``linger_s`` later,
    ``before_stop()``; then stop it, wait for its drain and close ``ledger`` (its own async
    ledger). Its run must not end before it is stopped: whatever it raises is raised here."""

    async def main() -> None:
        runner = asyncio.create_task(dispatcher.run())
        try:
            for _ in range(polls):
                await asyncio.sleep(0.05)
                assert not runner.done(), "the dispatch loop ended before it was stopped"
                if each is not None:
                    each()
                if done():
                    break
            await asyncio.sleep(linger_s)
            if before_stop is not None:
                before_stop()
        finally:
            dispatcher.stop()
            await asyncio.wait_for(runner, 30)
            await ledger.aclose()

    asyncio.run(main())


def preempt_the_first_run(
    dispatcher: NodeDispatcher,
    stores: tuple[Repository, Ledger, AsyncLedger],
    node: str,
    job: str,
    started: asyncio.Event,
    check: Callable[[dict[str, Any], PoolSnapshot, Lease], None],
) -> dict[str, Any]:
    """Run ``dispatcher`` (over ``stores``: those of :func:`stand_in_node`) until ``started``
    is set (20 s at most): its engine began the first run of ``job``'s one item. Then, the
    item running and ``node``'s pool holding one lease, ``check(item, pool, lease)``; preempt
    that lease, wait (20 s at most) for the item to succeed, stop the dispatcher and close its
    async ledger; returns the item as stored then (:func:`only_item`)."""
    repo, ledger, aledger = stores

    async def scenario() -> None:
        runner = asyncio.create_task(dispatcher.run())
        try:
            await asyncio.wait_for(started.wait(), 20)
            running = only_item(repo, job)
            assert running["state"] == ItemState.RUNNING.value
            snap = ledger.snapshot(node)
            assert snap is not None
            (lease,) = snap.leases
            check(running, snap, lease)
            assert ledger.preempt(node, 1, victims=[lease.lease_id]).victims
            end = time.monotonic() + 20
            while only_item(repo, job)["state"] != ItemState.SUCCEEDED.value:
                assert time.monotonic() < end, only_item(repo, job)
                await asyncio.sleep(0.05)
        finally:
            dispatcher.stop()
            await asyncio.wait_for(runner, 30)
            await aledger.aclose()

    asyncio.run(scenario())
    return only_item(repo, job)


AsyncLedgerT = TypeVar("AsyncLedgerT", bound=AsyncLedger)


@contextmanager
def stand_in_node(
    settings: Settings,
    node: str,
    block: int,
    blocks: int = 64,
    async_ledger: type[AsyncLedgerT] = AsyncLedger,  # type: ignore[assignment]
) -> Iterator[tuple[Repository, Ledger, AsyncLedgerT]]:
    """The stores of a dispatcher test: a repository, the ledger (sync, and the async one of
    type ``async_ledger`` a dispatcher takes), with ``node`` registered as a stand-in serving
    model ``m`` over ``blocks`` blocks of ``block`` tokens and the ledger rebuilt for it. The
    repository and the sync ledger close on leaving; the dispatcher's run closes its own."""
    repo = Repository.connect(settings.database_url, pool_size=4)
    policy = pool_policy(settings)
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace, policy)
    aledger = cast(
        AsyncLedgerT, async_ledger.from_url(settings.redis_url, settings.redis_namespace, policy)
    )
    try:
        repo.nodes.upsert_node(node, "http://stand-in", "m", blocks, block, 0)
        ensure_ledger(repo, ledger, max_preemptions=3)
        yield repo, ledger, aledger
    finally:
        ledger.close()
        repo.close()
