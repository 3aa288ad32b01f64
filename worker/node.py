"""One GPU node's worker: find the engine, measure its pool, register it, dispatch.

``run_node`` is the whole life of a node's dispatcher as one coroutine; ``NodeThread`` runs it
beside a Celery worker (``backfill worker``), which carries the maintenance tasks.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import traceback
from dataclasses import dataclass, replace

from backfill.config import Settings
from backfill.engine.http import HttpEngine
from backfill.engine.protocol import Endpoint, EngineError, ModelInfo
from backfill.engine_metrics import EnginePool
from backfill.ledger import AsyncLedger, Ledger
from backfill.maintenance import ensure_ledger, pool_policy
from backfill.store import Repository
from backfill.work_signals import work_budget_policy
from worker.dispatch import DispatchConfig, DispatchStats, NodeDispatcher
from worker.summary_wake import SummaryWaker

log = logging.getLogger("backfill.worker")


@dataclass(frozen=True)
class EngineFacts:
    pool: EnginePool
    model: ModelInfo
    endpoints: frozenset[Endpoint]
    """The batch endpoints the engine serves (its runner's routes)."""


async def wait_for_engine(
    engine: HttpEngine, stop: asyncio.Event, *, retry_s: float = 2.0, max_retry_s: float = 30.0
) -> EngineFacts | None:
    """The engine's measured pool and served model; retries (saying so) until it answers.

    Returns None if told to stop first. A worker whose engine is down waits loudly instead
    of crash-looping.
    """
    delay = retry_s
    while not stop.is_set():
        try:
            pool = await engine.pool()
            models = await engine.models()
            if not models:
                raise EngineError("the engine serves no model")
            return EngineFacts(pool, models[0], await engine.endpoints())
        except (EngineError, OSError) as exc:
            log.warning(
                "engine at %s is not answering (%s); retrying in %.0f s",
                engine.base_url,
                exc,
                delay,
            )
        try:
            await asyncio.wait_for(stop.wait(), delay)
        except TimeoutError:
            delay = min(delay * 2, max_retry_s)
    return None


def dispatch_config(settings: Settings, node: str) -> DispatchConfig:
    return DispatchConfig(
        node=node,
        claim_batch=settings.claim_batch_size,
        max_in_flight=settings.max_in_flight_per_node,
        lease_ttl_s=settings.lease_ttl_s,
        heartbeat_interval_s=settings.heartbeat_interval_s,
        batch_priority=settings.batch_priority,
        stream_interval=settings.batch_stream_interval,
        tenant_cache_salt=settings.tenant_cache_salt,
        max_preemptions=settings.max_preemptions_per_item,
        max_attempts=settings.max_attempts_per_item,
        grace_s=settings.shutdown_grace_s,
        work_budget=(
            work_budget_policy(settings, settings.max_in_flight_per_node)
            if settings.work_budget_enabled
            else None
        ),
        budget_interval_s=settings.work_budget_interval_s,
        budget_interval_with_scheduler_s=settings.work_budget_interval_with_scheduler_s,
        signal_ttl_s=settings.work_signal_ttl_s,
        stall_timeout_s=settings.batch_stream_stall_s,
        prefix_pass_hold_s=settings.prefix_pass_hold_s,
        first_prefill_wait_s=settings.prefix_first_prefill_wait_s,
        scheduler_metrics_url=settings.engine_scheduler_metrics_url,
    )


async def run_node(
    settings: Settings,
    node: str,
    engine_url: str,
    stop: asyncio.Event,
    *,
    started: threading.Event | None = None,
    holder: list[NodeDispatcher] | None = None,
) -> DispatchStats:
    """Serve ``node`` until ``stop`` is set; returns what was done."""
    policy = pool_policy(settings)
    key = settings.engine_api_key
    async with HttpEngine(
        engine_url, api_key=key.get_secret_value() if key is not None else None
    ) as engine:
        facts = await wait_for_engine(engine, stop)
        if facts is None:
            return DispatchStats()
        pool, model = facts.pool, facts.model
        reserve = policy.reserve_tokens(pool.capacity_tokens)
        repo = Repository.connect(
            settings.database_url, pool_size=4, fair_share=settings.fair_share
        )
        ledger = Ledger.from_url(
            settings.redis_url,
            settings.redis_namespace,
            policy,
            lease_ttl_ms=int(settings.lease_ttl_s * 1000),
        )
        aledger = AsyncLedger.from_url(
            settings.redis_url,
            settings.redis_namespace,
            policy,
            lease_ttl_ms=int(settings.lease_ttl_s * 1000),
        )
        # Summary jobs' reduce steps are made as their chunks' items end here, not a tick later.
        waker = SummaryWaker(repo, settings)
        try:
            await _register_node(settings, node, engine_url, facts, reserve, repo, ledger, aledger)
            limit = policy.batch.max_sequence_tokens
            if model.max_model_len:
                limit = min(limit, model.max_model_len)
            dispatcher = NodeDispatcher(
                replace(dispatch_config(settings, node), prefix_caching=pool.prefix_caching),
                engine,
                repo,
                aledger,
                model=model.id,
                block_size=pool.block_size,
                max_sequence_tokens=limit,
            )
            dispatcher.prefix_jobs = repo.prefixes
            dispatcher.items_ended = waker.start().items_ended
            if holder is not None:
                holder.append(dispatcher)
            log.info(
                "node %s: engine %s serves %s (%s); pool %s tokens (%s blocks of %s), "
                "interactive reserve %s",
                node,
                engine_url,
                model.id,
                ", ".join(sorted(facts.endpoints)) or "no batch endpoint",
                pool.capacity_tokens,
                pool.num_blocks,
                pool.block_size,
                reserve,
            )
            if started is not None:
                started.set()
            return await _run_until(dispatcher, stop)
        finally:
            await asyncio.to_thread(waker.stop)
            await aledger.aclose()
            ledger.close()
            repo.close()


async def _register_node(
    settings: Settings,
    node: str,
    engine_url: str,
    facts: EngineFacts,
    reserve: int,
    repo: Repository,
    ledger: Ledger,
    aledger: AsyncLedger,
) -> None:
    """Record ``node`` and its engine in Postgres and its pool in the ledger."""
    pool = facts.pool
    await asyncio.to_thread(
        repo.nodes.upsert_node,
        node,
        engine_url,
        facts.model.id,
        pool.num_blocks,
        pool.block_size,
        reserve,
        facts.endpoints,
    )
    # A fresh (or emptied) Redis is rebuilt from Postgres before this node admits
    # anything; the rebuild registers every known pool, this one included.
    await asyncio.to_thread(
        ensure_ledger, repo, ledger, max_preemptions=settings.max_preemptions_per_item
    )
    await aledger.register_pool(node, pool.capacity_tokens, pool.block_size)


async def _run_until(dispatcher: NodeDispatcher, stop: asyncio.Event) -> DispatchStats:
    """Run ``dispatcher`` until ``stop`` is set (or it ends); what it did."""
    runner = asyncio.create_task(dispatcher.run())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    dispatcher.stop()
    stopper.cancel()
    await runner
    return dispatcher.stats


class NodeThread(threading.Thread):
    """Runs :func:`run_node` on its own event loop, beside a Celery worker's main thread."""

    def __init__(self, settings: Settings, node: str, engine_url: str) -> None:
        super().__init__(name=f"node-{node}", daemon=True)
        self.settings = settings
        self.node = node
        self.engine_url = engine_url
        self.started = threading.Event()
        self.stats: DispatchStats | None = None
        self.error: BaseException | None = None
        self.dispatchers: list[NodeDispatcher] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()

    def run(self) -> None:
        async def main() -> DispatchStats:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            self._ready.set()
            return await run_node(
                self.settings,
                self.node,
                self.engine_url,
                self._stop_event,
                started=self.started,
                holder=self.dispatchers,
            )

        try:
            self.stats = asyncio.run(main())
        except BaseException as exc:
            self.error = exc
            log.exception("node %s stopped on an error", self.node)
            self._ready.set()

    def stop(self) -> None:
        """Ask the dispatcher to stop (grace period, then requeue); returns at once."""
        self._ready.wait(10)
        if self._loop is not None and self._stop_event is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_event.set)

    def where(self, timeout: float = 2.0) -> str:
        """Where the dispatcher stands: its thread's stack, and each task of its loop with the
        line it waits on (asked of the loop itself; if the loop does not answer, it is blocked
        and the thread's stack says on what). For a stop that overran."""
        frame = sys._current_frames().get(self.ident or -1)
        text = ["thread:\n" + "".join(traceback.format_stack(frame)) if frame else "thread: gone"]
        loop = self._loop
        if loop is None or loop.is_closed():
            return "\n".join(text)

        async def tasks() -> str:
            return "\n".join(_task_line(t) for t in asyncio.all_tasks())

        try:
            text.append(asyncio.run_coroutine_threadsafe(tasks(), loop).result(timeout))
        except Exception as exc:  # the loop is blocked (or closing): the stack above says where
            text.append(f"tasks: the loop did not answer ({type(exc).__name__})")
        return "\n".join(text)


def _task_line(task: asyncio.Task[object]) -> str:
    """A task's name and its chain of awaits, outermost first, down to what it waits on."""
    waits: list[str] = []
    awaited: object = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None:
            name = frame.f_code.co_filename.rsplit("/", 1)[-1]
            waits.append(f"{name}:{frame.f_lineno} {frame.f_code.co_name}")
        nxt = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
        if nxt is None and frame is None:
            waits.append(type(awaited).__name__)
        awaited = nxt
    return f"task {task.get_name()}: " + " > ".join(waits)
