"""A worker or a gateway whose clock is off by a minute judges time on the shared clocks:
deadlines and ``not_before`` on Postgres' (the repository computes them in SQL), the work
budget's signals and published budgets on Redis' (``backfill.clock.SharedClock``).

Before, the worker compared Postgres' deadlines with its own clock (an item with 30 s left was
expired at once by a worker a minute ahead, and started though it could not finish by one a
minute behind), wrote ``not_before`` from its own clock (a deferred item came back at once, or
a minute late), and judged gateways' signal stamps by its own clock (a live gateway's signals
stale, a dead one's fresh for a minute); the API judged the workers' published budgets by its.

Real Postgres and Redis. The engine is a stand-in (its output is not what this is about), and
each process's clock is skewed through its ``host_clock`` (a test cannot move the host's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy import text

from backfill.config import Settings
from backfill.engine.protocol import Engine
from backfill.ledger import AsyncLedger, Lease, Ledger
from backfill.maintenance import ensure_ledger, pool_policy
from backfill.policy import ServiceClass
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository
from backfill.work_signals import read_budget, work_budget_policy
from queue_api.gateway import InteractiveGateway
from tests.integration.standin_engine import StandInEngine
from worker.dispatch import DispatchConfig, NodeDispatcher

NODE = "n-skew"
BLOCK = 16  # the stand-in engine's pool: 64 blocks of 16
BLOCKS = 64
SKEWS = [pytest.param(60.0, id="ahead-60s"), pytest.param(-60.0, id="behind-60s")]


def skewed(skew_s: float) -> Callable[[], float]:
    return lambda: time.time() + skew_s


class Services:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.repo = Repository.connect(settings.database_url, pool_size=4)
        self.policy = pool_policy(settings)
        self.ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace, self.policy)
        self.repo.nodes.upsert_node(NODE, "http://stand-in", "m", BLOCKS, BLOCK, 0)
        ensure_ledger(self.repo, self.ledger, max_preemptions=3)

    def submit(self, max_tokens: list[int], deadline_in_s: float = 3600.0) -> str:
        tenant = self.repo.tenants.create_tenant(f"t-{time.monotonic_ns()}")
        f = self.repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
        job = self.repo.jobs.create_job(
            tenant.id,
            f.id,
            "/v1/completions",
            "1h",
            # The test host is Postgres' host: its clock is the database's.
            datetime.now(UTC) + timedelta(seconds=deadline_in_s),
        )
        items = [
            NewItem(i, f"r{i}", json.dumps({"model": "m", "prompt": "x", "max_tokens": m}), m)
            for i, m in enumerate(max_tokens)
        ]
        self.repo.ingest.insert_items(job.id, items)
        self.repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        return job.id

    def dispatcher(
        self, engine: StandInEngine, host_clock: Callable[[], float], **config: Any
    ) -> tuple[NodeDispatcher, AsyncLedger]:
        aledger = AsyncLedger.from_url(
            self.settings.redis_url, self.settings.redis_namespace, self.policy
        )
        values: dict[str, Any] = {
            "node": NODE,
            "idle_poll_s": 0.05,
            "observe_interval_s": 0,
            "stall_timeout_s": 0,
        }
        values.update(config)
        dispatcher = NodeDispatcher(
            DispatchConfig(**values),
            cast(Engine, engine),
            self.repo,
            aledger,
            model="m",
            block_size=BLOCK,
            max_sequence_tokens=512,
            host_clock=host_clock,
        )
        return dispatcher, aledger

    def close(self) -> None:
        self.ledger.close()
        self.repo.close()


@pytest.fixture
def services(settings: Settings) -> Any:
    s = Services(settings)
    try:
        yield s
    finally:
        s.close()


async def run_until(
    dispatcher: NodeDispatcher,
    aledger: AsyncLedger,
    done: Callable[[], bool],
    timeout_s: float = 30.0,
    during: Callable[[], Awaitable[None]] | None = None,
) -> None:
    runner = asyncio.create_task(dispatcher.run())
    try:
        end = time.monotonic() + timeout_s
        while not done() and time.monotonic() < end:
            if during is not None:
                await during()
            await asyncio.sleep(0.05)
    finally:
        dispatcher.stop()
        await asyncio.wait_for(runner, 30)
        await aledger.aclose()


# ---------------------------------------------------------------------------------------------
# (a) Deadlines


@pytest.mark.parametrize("skew_s", SKEWS)
def test_an_item_with_30s_left_is_judged_on_the_databases_clock(
    services: Services, skew_s: float
) -> None:
    """30 s before the deadline, at 10 tokens/s: an item of 8 tokens (about 1 s) runs, one of
    400 (about 40 s) is expired unstarted, whichever way the worker's clock is off."""
    job = services.submit([8, 400], deadline_in_s=30.0)
    engine = StandInEngine()
    dispatcher, aledger = services.dispatcher(engine, skewed(skew_s), decode_tokens_per_s=10.0)

    def settled() -> bool:
        counts = services.repo.stats.counted_states(job)
        return counts.get(ItemState.SUCCEEDED, 0) + counts.get(ItemState.EXPIRED, 0) == 2

    asyncio.run(run_until(dispatcher, aledger, settled))

    states = {r.custom_id: r.state for r in services.repo.items.items(job)}
    assert states == {"r0": ItemState.SUCCEEDED, "r1": ItemState.EXPIRED}
    assert len(engine.streamed) == 1  # the infeasible item was never sent


# ---------------------------------------------------------------------------------------------
# (b) not_before


def _retry_delay_s(repo: Repository, job: str) -> float:
    """Seconds between the end of an item's last attempt and its ``not_before``, both
    written by Postgres' clock: the retry delay the worker asked for."""
    with repo.engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT EXTRACT(EPOCH FROM (i.not_before - a.ended_at)) FROM items i "
                "JOIN attempts a ON a.item_id = i.id AND a.attempt = i.attempt "
                "WHERE i.job_id = :j"
            ),
            {"j": job},
        ).one()
    assert row[0] is not None, "the item was given back without a not_before"
    return float(row[0])


@pytest.mark.parametrize("skew_s", SKEWS)
def test_a_deferred_item_waits_its_retry_hint_on_the_databases_clock(
    services: Services, skew_s: float
) -> None:
    """No slack now: the item is deferred for the ledger's retry hint (1 s), not for a minute
    more, nor already due."""
    held = services.ledger.reserve(NODE, ServiceClass.INTERACTIVE, 0, 700, ttl_ms=120_000)
    assert isinstance(held, Lease)
    snap = services.ledger.snapshot(NODE)
    assert snap is not None
    assert BLOCK <= snap.slack < 400  # room to claim, not to reserve the item
    job = services.submit([400])
    dispatcher, aledger = services.dispatcher(StandInEngine(), skewed(skew_s))

    asyncio.run(run_until(dispatcher, aledger, lambda: dispatcher.stats.deferred >= 1))

    counts = services.repo.stats.counted_states(job)
    assert counts.get(ItemState.DEFERRED) == 1, counts
    delay = _retry_delay_s(services.repo, job)
    assert 0.5 <= delay <= 5.0, delay


@pytest.mark.parametrize("skew_s", SKEWS)
def test_a_failed_attempt_backs_off_on_the_databases_clock(
    services: Services, skew_s: float
) -> None:
    """An attempt that broke in the worker is requeued to wait its backoff (0.25 s after the
    first attempt), not a minute more, nor already due."""
    job = services.submit([8])
    dispatcher, aledger = services.dispatcher(StandInEngine(fail_after=0), skewed(skew_s))

    asyncio.run(run_until(dispatcher, aledger, lambda: dispatcher.stats.requeued >= 1))

    delay = _retry_delay_s(services.repo, job)
    assert 0.0 < delay <= 5.0, delay


# ---------------------------------------------------------------------------------------------
# (c) Gateway signals and published budgets


def _budget_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "work_signal_ttl_s": 0.6,
            "work_budget_quiet_s": 0.2,
            "work_budget_interval_s": 0.05,
        }
    )


@pytest.mark.parametrize("gateway_skew_s", SKEWS)
def test_gateway_signals_from_a_skewed_host_are_fresh_while_written_and_stale_after(
    services: Services, gateway_skew_s: float
) -> None:
    """A gateway a minute off holds batch back while one of its requests waits for room; once
    it dies (another gateway's entry keeps the hash alive), its entry goes stale within the
    TTL and batch is no longer held for it."""
    s = _budget_settings(services.settings)
    ttl = s.work_signal_ttl_s
    dispatcher, aledger = services.dispatcher(
        StandInEngine(),
        time.time,
        work_budget=work_budget_policy(s),
        budget_interval_s=s.work_budget_interval_s,
        signal_ttl_s=ttl,
    )
    held: dict[str, bool] = {}

    async def scenario() -> None:
        skewed_gw = InteractiveGateway(s, services.repo, host_clock=skewed(gateway_skew_s))
        live_gw = InteractiveGateway(s, services.repo)
        try:
            # As a request does: the publisher starts (its clock anchored), then the request
            # arrives. The live gateway has one in prefill all along: its entry keeps the hash.
            await live_gw.admission.signals.start()
            prefilling = live_gw.admission.signals.activity.arrived([NODE])
            prefilling.admitted(NODE)
            await skewed_gw.admission.signals.start()
            waiting = skewed_gw.admission.signals.activity.arrived([NODE])
            runner = asyncio.create_task(dispatcher.run())
            try:

                def budget_held() -> bool:
                    return dispatcher.work_budget is not None and dispatcher.work_budget.hold

                held["while_waiting"] = await _eventually(budget_held, 5.0)
                # The skewed gateway dies with its request still waiting: no cleanup.
                assert skewed_gw.admission.signals._publisher is not None
                skewed_gw.admission.signals._publisher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await skewed_gw.admission.signals._publisher
                del waiting
                held["after_death"] = not await _eventually(
                    lambda: not budget_held(), 5 * ttl + 2.0
                )
            finally:
                dispatcher.stop()
                await asyncio.wait_for(runner, 30)
        finally:
            await skewed_gw.aclose()
            await live_gw.aclose()
            await aledger.aclose()

    asyncio.run(scenario())
    assert held == {"while_waiting": True, "after_death": False}


async def _eventually(cond: Callable[[], bool], timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        await asyncio.sleep(0.02)
    return cond()


@pytest.mark.parametrize("worker_skew_s", SKEWS)
def test_a_skewed_workers_budget_is_shown_while_it_runs_and_dropped_after(
    services: Services, worker_skew_s: float
) -> None:
    """The API shows a worker's budget while the worker runs, whichever way its clock is off,
    and stops counting it within its TTL once it stops (another worker's entry keeps the
    hash alive)."""
    s = _budget_settings(services.settings)
    keys = services.ledger.keys
    client = services.ledger.client
    config = {
        "work_budget": work_budget_policy(s),
        "budget_interval_s": s.work_budget_interval_s,
        "signal_ttl_s": s.work_signal_ttl_s,
    }
    skewed_worker, skewed_ledger = services.dispatcher(
        StandInEngine(), skewed(worker_skew_s), **config
    )
    other_worker, other_ledger = services.dispatcher(StandInEngine(), time.time, **config)
    seen: dict[str, int | None] = {}

    def workers() -> int | None:
        view = read_budget(client, keys, NODE)
        return None if view is None else view.workers

    async def scenario() -> None:
        other = asyncio.create_task(other_worker.run())
        try:
            await run_until(
                skewed_worker,
                skewed_ledger,
                lambda: workers() == 2,
                timeout_s=5.0,
            )
            seen["while_running"] = workers()
            # Published budgets count for max(5 s, signal TTL) after their last write.
            await _eventually(lambda: workers() == 1, 8.0)
            seen["after_stop"] = workers()
        finally:
            other_worker.stop()
            await asyncio.wait_for(other, 30)
            await other_ledger.aclose()

    asyncio.run(scenario())
    assert seen == {"while_running": 2, "after_stop": 1}
