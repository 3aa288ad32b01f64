"""Scenario 8: the engine hangs (its engine core stopped with SIGSTOP: the API server still
answers, its counters stand still, streams stay open and send nothing). The worker stops the
attempts it holds there after the stall timeout, as engine errors (requeued, leases released),
sends one item at a time while the engine makes no progress, and once the engine runs again
the job completes with every item exactly once. Before, the items and their leases were held
until the deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from backfill.states import ItemState
from tests.e2e.helpers import engine_core
from tests.reliability.conftest import EngineHandle, start_engine
from tests.reliability.services import WorkerProcess, worker_env
from tests.reliability.support import Deployment, maintenance, report

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

STALL_S = 4.0


@pytest.fixture
def hangable(engine: EngineHandle) -> Iterator[EngineHandle]:
    """The suite's engine when this suite started it (it runs on again once resumed), else
    one of this test's own."""
    handle = engine if engine.owned else start_engine()
    try:
        yield handle
    finally:
        if handle.server is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(handle.server.pid, signal.SIGCONT)
        if handle is not engine:
            handle.close()


def test_a_hung_engine_gives_its_items_back_and_the_job_completes_once_it_runs_again(
    deployment: Deployment, hangable: EngineHandle, workdir: Path
) -> None:
    d = deployment
    d.engine_url = hangable.url
    assert hangable.server is not None
    core = engine_core(hangable.server.pid)
    n = 40
    job = d.submit(n, max_tokens=200, tag="hang")
    s = d.settings
    env = worker_env(
        s.database_url,
        s.redis_url,
        s.redis_namespace,
        lease_ttl_s=s.lease_ttl_s,
        heartbeat_interval_s=s.heartbeat_interval_s,
        shutdown_grace_s=s.shutdown_grace_s,
        max_in_flight_per_node=16,
        batch_stream_stall_s=STALL_S,
        work_budget_enabled=False,
    )
    worker = WorkerProcess(d.node, d.engine_url, env, workdir / "worker.log")
    try:
        with maintenance(d):
            worker.start()
            worker.wait_ready()
            d.wait(lambda: d.counts(job).get(ItemState.RUNNING, 0) >= 4, 180, "items running")
            os.kill(core, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                held = d.counts(job).get(ItemState.RUNNING, 0)
                # Every attempt on the hung engine is stopped, save at most the one probe
                # the worker keeps sending while the engine makes no progress.
                released_s = d.wait(
                    lambda: d.counts(job).get(ItemState.RUNNING, 0) <= 1,
                    STALL_S + 60,
                    "the attempts on the hung engine stopped",
                )
                stalled = d.sql(
                    "SELECT count(*) FROM attempts a JOIN items i ON i.id = a.item_id "
                    "WHERE i.job_id = :j AND a.detail LIKE '%made no progress%'",
                    j=job,
                )[0][0]
                hung_s = time.monotonic() - stopped
            finally:
                os.kill(core, signal.SIGCONT)
            d.wait(lambda: d.done(job) == n, 600, "every item once the engine runs again")
            d.assert_no_leak()
            worker.terminate()
    finally:
        worker.close()
    once = d.assert_exactly_once(job, n)
    assert stalled >= held - 1, f"{held} attempts held, {stalled} stopped as stalls"
    report(
        "8 engine hang (SIGSTOP of the engine core) and resume",
        items=n,
        running_at_hang=held,
        stopped_within_s=round(released_s, 2),
        stall_timeout_s=STALL_S,
        attempts_stopped_as_stalls=stalled,
        hung_for_s=round(hung_s, 1),
        **once,
    )
