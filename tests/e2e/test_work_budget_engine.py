"""The node worker honours its batch work budget against a real vLLM server.

A fake gateway signal in Redis (what ``queue_api/gateway.py`` publishes) says interactive
requests wait on the node: the worker shrinks its budget to the floor, holds new batch
prefills, and batch in flight drains to the floor; when the signal clears the budget grows
back and batch fills it again. A signal that an interactive request is about to miss its TTFT
target makes the worker preempt batch, which resumes and completes exactly once. The budget
and why it last changed are in the capacity view.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import redis

from backfill.capacity_view import capacity_report, ledger_usage
from backfill.config import Settings
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository
from backfill.telemetry import BackfillCollector
from backfill.work_budget import BudgetReason
from backfill.work_signals import InteractiveSignals
from devkit import devengine
from tests.e2e import helpers
from tests.e2e.helpers import wait
from worker.dispatch import NodeDispatcher
from worker.node import NodeThread

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

NODE = "wb1"
FLOOR = 2
CEILING = 16
MAX_TOKENS = 300
"""Long enough that batch is still decoding when the at-risk signal lands."""


@pytest.fixture(scope="module")
def small_engine() -> Iterator[str]:
    yield from helpers.engine_url(
        "tiny", num_gpu_blocks_override=96, max_model_len=512, kv_cache_gib=1
    )


@pytest.fixture
def budget_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "lease_ttl_s": 6.0,
            "heartbeat_interval_s": 1.0,
            "shutdown_grace_s": 3.0,
            "max_in_flight_per_node": 32,
            "interactive_reserve_fraction": 0.0,
            "work_budget_floor_seqs": FLOOR,
            "work_budget_ceiling_seqs": CEILING,
            "work_budget_increase_seqs": 4,
            "work_budget_quiet_s": 0.5,
            "work_budget_interval_s": 0.1,
            "interactive_ttft_target_s": 2.0,
        }
    )


@pytest.fixture
def stores(budget_settings: Settings) -> Iterator[tuple[Repository, Ledger, redis.Redis]]:
    s = budget_settings
    repo = Repository.connect(s.database_url, pool_size=4)
    ledger = Ledger.from_url(s.redis_url, s.redis_namespace, pool_policy(s), lease_ttl_ms=6000)
    client = redis.Redis.from_url(s.redis_url)
    yield repo, ledger, client
    client.close()
    ledger.close()
    repo.close()


@pytest.fixture
def node(budget_settings: Settings, small_engine: str) -> Iterator[NodeThread]:
    thread = NodeThread(budget_settings, NODE, small_engine)
    thread.start()
    assert thread.started.wait(60), f"node did not start: {thread.error}"
    yield thread
    thread.stop()
    thread.join(30)
    assert thread.error is None


def _submit(repo: Repository, n: int, max_tokens: int) -> str:
    tenant = repo.tenants.create_tenant(f"t-{time.monotonic_ns()}")
    f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        tenant.id, f.id, "/v1/completions", "1h", datetime.now(UTC) + timedelta(hours=1)
    )
    items = [
        NewItem(
            i,
            f"req-{i}",
            json.dumps(
                {
                    "model": "tiny",
                    "prompt": f"doc {i}: the fox",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                }
            ),
            max_tokens,
        )
        for i in range(n)
    ]
    repo.ingest.insert_items(job.id, items)
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    return job.id


class FakeGateway:
    """Writes the interactive signal a gateway process would publish for the node."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.client = client
        self.key = f"{settings.redis_namespace}:work:signals:{NODE}"

    def publish(self, signals: InteractiveSignals) -> None:
        self.client.hset(self.key, "fake-gateway", signals.to_json(time.time()))
        self.client.pexpire(self.key, 3000)

    def clear(self) -> None:
        self.client.delete(self.key)


def _dispatcher(node: NodeThread) -> NodeDispatcher:
    wait(lambda: bool(node.dispatchers), 30, "the dispatcher")
    return node.dispatchers[0]


def _code(d: NodeDispatcher) -> BudgetReason | None:
    return None if d.work_budget is None else d.work_budget.code


def test_budget_shrinks_holds_and_grows_back_with_the_interactive_signal(
    budget_settings: Settings,
    stores: tuple[Repository, Ledger, redis.Redis],
    node: NodeThread,
) -> None:
    repo, ledger, client = stores
    d = _dispatcher(node)
    gateway = FakeGateway(client, budget_settings)
    job = _submit(repo, 80, max_tokens=48)
    wait(lambda: d.in_flight > FLOOR + 2, 60, "batch to exceed the floor")

    # Interactive waits (not yet at risk: no preemption), kept fresh as a gateway would. A
    # shrink stops new starts at once; running items drain as they finish.
    held_since: float | None = None
    started_at_hold: int | None = None
    lowest = d.in_flight
    end = time.monotonic() + 120
    while time.monotonic() < end:
        gateway.publish(InteractiveSignals(waiting=1))
        budget = d.work_budget
        assert budget is not None
        if budget.hold and budget.max_seqs == FLOOR and held_since is None:
            held_since = time.monotonic()
        # A fill that passed its budget check just before the hold may still start its items.
        if held_since is not None and started_at_hold is None:
            if time.monotonic() - held_since > 1.0:
                started_at_hold, lowest = d.stats.started, d.in_flight
        elif started_at_hold is not None:
            assert d.stats.started == started_at_hold, "a batch item started during the hold"
            assert d.in_flight <= lowest, "batch in flight grew during the hold"
            lowest = d.in_flight
            if lowest <= FLOOR:
                break
        time.sleep(0.2)
    assert started_at_hold is not None, f"the budget never reached the floor: {d.work_budget}"
    assert lowest <= FLOOR, f"{lowest} still in flight after the hold"
    assert _code(d) is BudgetReason.INTERACTIVE_WAITING
    gateway.publish(InteractiveSignals(waiting=1))

    report = capacity_report(repo, ledger_usage(ledger))
    view = next(n.work_budget for n in report.nodes if n.name == NODE)
    assert view is not None
    assert view.hold
    assert view.max_seqs == FLOOR
    assert view.code == "interactive_waiting"
    assert "wait for admission" in view.reason

    gateway.clear()
    wait(
        lambda: d.work_budget is not None and d.work_budget.max_seqs == CEILING,
        20,
        "the budget to grow back to its ceiling",
    )
    assert _code(d) is BudgetReason.QUIET
    wait(lambda: d.in_flight > FLOOR, 30, "batch to use the grown budget")
    peak = 0
    while repo.stats.counted_states(job).get(ItemState.SUCCEEDED, 0) < 80:
        peak = max(peak, d.in_flight)
        assert d.in_flight <= CEILING
        time.sleep(0.05)
    assert peak > FLOOR


def test_an_interactive_request_at_risk_preempts_batch_which_resumes_once(
    budget_settings: Settings,
    stores: tuple[Repository, Ledger, redis.Redis],
    node: NodeThread,
) -> None:
    repo, _, client = stores
    d = _dispatcher(node)
    gateway = FakeGateway(client, budget_settings)
    jobs = [_submit(repo, 30, max_tokens=MAX_TOKENS)]
    wait(lambda: d.in_flight >= 8, 60, "batch in flight")
    # Pending for 10 s of a 2 s target: the target is spent, so the budget shrinks (to its
    # floor within a few steps) and batch over it is preempted, decoding or not. The signal is
    # kept fresh, as a gateway would while the request is still pending, until the worker has
    # preempted (90 s at most); batch is topped up meanwhile, so it is still in flight when the
    # signal is read (a loaded CI machine once ran 27 of the 30 items out first, preempting
    # none). 10 s, not just past the 1 s at-risk point: the worker reads the signal's age on
    # Redis' clock, anchored from here, whose reading a stalled loop can set back a second.
    end = time.monotonic() + 90
    while d.stats.budget_preemptions == 0 and time.monotonic() < end:
        gateway.publish(InteractiveSignals(prefilling=1, oldest_pending_since_s=time.time() - 10))
        if d.in_flight < 4 and len(jobs) < 10:
            jobs.append(_submit(repo, 30, max_tokens=MAX_TOKENS))
        time.sleep(0.1)
    assert d.stats.budget_preemptions > 0, (
        f"no work-budget preemption in 90 s over {len(jobs)} jobs: {d.work_budget}; "
        f"clock offset {d.clock.offset_s():+.3f} s"
    )
    assert _code(d) is BudgetReason.TTFT_AT_RISK
    gateway.clear()
    for job in jobs:
        wait(
            lambda j=job: repo.stats.counted_states(j).get(ItemState.SUCCEEDED, 0) == 30,
            240,
            "items",
        )
    done = [i for job in jobs for i in repo.items.items(job, states=[ItemState.SUCCEEDED])]
    assert any(i.preemptions > 0 for i in done), "no preempted item resumed"
    for item in done:
        usage = json.loads(item.result or "{}")["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS


@pytest.fixture(scope="module")
def scheduler_engine() -> Iterator[devengine.EngineServer]:
    yield from helpers.engine_server(
        "tiny", num_gpu_blocks_override=96, max_model_len=512, kv_cache_gib=1, scheduler=True
    )


def test_with_backfills_scheduler_in_the_engine_the_worker_preempts_nothing_for_ttft(
    budget_settings: Settings,
    stores: tuple[Repository, Ledger, redis.Redis],
    scheduler_engine: devengine.EngineServer,
) -> None:
    # The same at-risk signal that makes the worker preempt batch on a stock engine (the test
    # above): with the step scheduler in the engine, which pauses batch in the steps
    # interactive work needs, the worker detects it and throws no batch work away.
    repo, _, client = stores
    assert scheduler_engine.scheduler_metrics_url is not None
    s = budget_settings.model_copy(
        update={"engine_scheduler_metrics_url": scheduler_engine.scheduler_metrics_url}
    )
    thread = NodeThread(s, NODE, scheduler_engine.url)
    thread.start()
    try:
        assert thread.started.wait(60), f"node did not start: {thread.error}"
        d = _dispatcher(thread)
        wait(lambda: d.engine_scheduler is not None, 30, "the engine's scheduler detected")
        gateway = FakeGateway(client, s)
        job = _submit(repo, 30, max_tokens=MAX_TOKENS)
        wait(lambda: d.in_flight >= 8, 60, "batch in flight")
        end = time.monotonic() + 5
        while time.monotonic() < end:
            gateway.publish(
                InteractiveSignals(prefilling=1, oldest_pending_since_s=time.time() - 2.5)
            )
            time.sleep(0.1)
        assert d.stats.budget_preemptions == 0
        assert d.stats.preempted == 0
        gateway.clear()
        wait(lambda: repo.stats.counted_states(job).get(ItemState.SUCCEEDED, 0) == 30, 300, "items")
        done = repo.items.items(job, states=[ItemState.SUCCEEDED])
        assert all(i.preemptions == 0 for i in done)
        report = capacity_report(repo, ledger_usage(stores[1]))
        [view] = [n for n in report.nodes if n.name == NODE]
        assert view.engine_scheduler is not None
    finally:
        thread.stop()
        thread.join(30)
    assert thread.error is None


def test_a_worker_whose_batch_priority_the_engine_does_not_take_keeps_preempting_for_ttft(
    budget_settings: Settings,
    stores: tuple[Repository, Ledger, redis.Redis],
    scheduler_engine: devengine.EngineServer,
) -> None:
    # The engine's scheduler takes priority >= 10 as batch; this worker sends 11. The engine
    # would still pause it, but a mismatch is a misconfiguration the worker does not trust:
    # it says so in one line, publishes it (a metric), and its work budget keeps preempting
    # for interactive TTFT as on a stock engine.
    repo, ledger, client = stores
    assert scheduler_engine.scheduler_metrics_url is not None
    s = budget_settings.model_copy(
        update={
            "engine_scheduler_metrics_url": scheduler_engine.scheduler_metrics_url,
            "batch_priority": 11,
        }
    )
    thread = NodeThread(s, NODE, scheduler_engine.url)
    errors: list[str] = []
    infos: list[str] = []
    catch = logging.Handler(logging.INFO)
    catch.emit = lambda record: (  # type: ignore[method-assign]
        errors if record.levelno >= logging.ERROR else infos
    ).append(record.getMessage())
    worker_log = logging.getLogger("backfill.worker")
    level = worker_log.level
    worker_log.setLevel(logging.INFO)
    worker_log.addHandler(catch)
    try:
        thread.start()
        try:
            assert thread.started.wait(60), f"node did not start: {thread.error}"
            d = _dispatcher(thread)
            wait(lambda: d.engine_scheduler is not None, 30, "the engine's scheduler detected")
            assert not d.engine_pauses_batch
            said = [e for e in errors if "takes priority" in e]
            assert len(said) == 1, said
            assert "takes priority >= 10 as batch, this worker sends batch at 11" in said[0]
            assert "\n" not in said[0]
            # Nor does it say the engine pauses its batch (it would, but is not trusted to).
            assert not [i for i in infos if "pauses batch" in i], infos
            assert [i for i in infos if "the work budget preempts" in i], infos
            gateway = FakeGateway(client, s)
            jobs = [_submit(repo, 30, max_tokens=MAX_TOKENS)]
            wait(lambda: d.in_flight >= 8, 60, "batch in flight")
            # As in the at-risk test above: the signal kept fresh (10 s pending of a 2 s
            # target) and batch topped up until the worker has preempted (90 s at most): beside
            # two busy loops, 15 s of a 2.5 s signal shrank the budget but preempted nothing.
            end = time.monotonic() + 90
            while d.stats.budget_preemptions == 0 and time.monotonic() < end:
                gateway.publish(
                    InteractiveSignals(prefilling=1, oldest_pending_since_s=time.time() - 10)
                )
                if d.in_flight < 4 and len(jobs) < 10:
                    jobs.append(_submit(repo, 30, max_tokens=MAX_TOKENS))
                time.sleep(0.1)
            assert d.stats.budget_preemptions > 0, (
                f"no work-budget preemption in 90 s over {len(jobs)} jobs: {d.work_budget}"
            )
            gateway.clear()
            metrics = list(BackfillCollector(repo, ledger).collect())
            [mismatch] = [
                m for m in metrics if m.name == "backfill_engine_scheduler_priority_mismatch"
            ]
            assert [(x.labels["node"], x.value) for x in mismatch.samples] == [(NODE, 1)]
            for job in jobs:
                wait(
                    lambda j=job: repo.stats.counted_states(j).get(ItemState.SUCCEEDED, 0) == 30,
                    300,
                    "items",
                )
        finally:
            thread.stop()
            thread.join(30)
    finally:
        worker_log.removeHandler(catch)
        worker_log.setLevel(level)
    assert thread.error is None
