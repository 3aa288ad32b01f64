"""Postgres out of reach, as a caller of the repository meets it on a real server: every
pooled connection busy (SQLAlchemy's pool times out), or the connection killed under a call.

Either is the store's unavailability, not a bug: the API answers 503 with Retry-After (never
500), and the worker's result writer keeps its results and commits them once the store is
back, instead of dying and leaving its finished items heartbeated forever.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest
from batch_api_support import api_settings, make_tenant
from fastapi.testclient import TestClient
from sqlalchemy import create_engine

from backfill.config import Settings
from backfill.engine.protocol import Engine
from backfill.errors import StoreUnavailable
from backfill.ledger import AsyncLedger, Lease, Ledger
from backfill.maintenance import ensure_ledger, pool_policy
from backfill.states import ItemState, JobState
from backfill.store import Finish, NewItem, Repository, Start
from queue_api.app import create_app
from tests.integration.pg_faults import kill_connections
from worker.dispatch import DispatchConfig, NodeDispatcher
from worker.dispatch_state import Flight
from worker.prepare import run_plan

CAPACITY, BLOCK = 64 * 128, 128
# Only how long a caller waits for a pooled connection before it is told the store is busy.
POOL_TIMEOUT_S = 0.5
HANG_S = 60


@pytest.fixture
def small_repo(settings: Settings) -> Iterator[Repository]:
    """A repository whose pool holds one connection and no overflow."""
    engine = create_engine(
        settings.database_url, pool_size=1, max_overflow=0, pool_timeout=POOL_TIMEOUT_S
    )
    repo = Repository(engine)
    yield repo
    repo.close()


def test_the_api_answers_503_with_retry_after_while_no_connection_is_free(
    settings: Settings, small_repo: Repository
) -> None:
    tenant = make_tenant(small_repo, "acme")
    app = create_app(api_settings(settings), repository=small_repo)
    headers = {"Authorization": f"Bearer {tenant.key}"}
    with TestClient(app) as http:
        assert http.get("/v1/batches", headers=headers).status_code == 200
        held = small_repo.engine.connect()  # the pool's one connection, busy elsewhere
        try:
            for path in ("/v1/batches", "/v1/files"):
                busy = http.get(path, headers=headers)
                assert busy.status_code == 503, (path, busy.text)
                assert busy.headers.get("retry-after"), path
                assert busy.json()["error"]["code"] == "store_unavailable"
        finally:
            held.close()
        assert http.get("/v1/batches", headers=headers).status_code == 200


def test_a_connection_killed_under_a_driver_level_read_is_store_unavailable(
    settings: Settings, small_repo: Repository
) -> None:
    tenant = small_repo.tenants.create_tenant("acme")
    record = small_repo.files.create_file(tenant.id, "batch", "in.jsonl", b"{}\n")
    assert b"".join(small_repo.files.file_pieces(tenant.id, record.id) or []) == b"{}\n"
    assert kill_connections(settings.database_url) >= 1
    # The pooled connection is dead; the binary read goes through the driver directly.
    with pytest.raises(StoreUnavailable):
        b"".join(small_repo.files.file_pieces(tenant.id, record.id) or [])
    # The pool replaced the dead connection: the next call works.
    assert b"".join(small_repo.files.file_pieces(tenant.id, record.id) or []) == b"{}\n"


def test_the_hot_path_meets_a_server_that_refuses_connections_as_store_unavailable(
    settings: Settings,
) -> None:
    """A Postgres restarting refuses new connections: the pool's connect raises the driver's
    own error, which the hot path (open claim, finish) must read as unavailable. It crashed
    every worker of a node instead, until the store came back to no one claiming."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    url = settings.database_url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{port}/")
    assert url != settings.database_url
    repo = Repository(create_engine(url, pool_size=1, max_overflow=0))
    try:
        with pytest.raises(StoreUnavailable):
            repo.claims.open_claim("n1", 4, 30)
        with pytest.raises(StoreUnavailable):
            repo.items.finish([Finish(1, 1, 1, ItemState.SUCCEEDED, result="{}")])
    finally:
        repo.close()


def _running_item(repo: Repository, ledger: Ledger) -> tuple[Flight, Finish]:
    tenant = repo.tenants.create_tenant("acme")
    job = repo.jobs.create_job(
        tenant.id, "file-x", "/v1/completions", "1h", datetime.now(UTC) + timedelta(hours=1)
    )
    repo.ingest.insert_items(job.id, [NewItem(0, "c0", json.dumps({"prompt": "x"}), 100)])
    repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
    repo.nodes.upsert_node("n1", "http://127.0.0.1:1", "m", CAPACITY // BLOCK, BLOCK, 0)
    ensure_ledger(repo, ledger, max_preemptions=3)
    ledger.register_pool("n1", CAPACITY, BLOCK)
    opened = repo.claims.open_claim("n1", 1, 30)
    [item] = opened.items
    lease = ledger.reserve("n1", "batch", 20, 100)
    assert isinstance(lease, Lease)
    start = Start(item.id, item.attempt, lease.lease_id, lease.fencing_token, lease.tokens, 20)
    assert repo.claims.start_claim(opened, [start]) == [item.id]
    finish = Finish(item.id, item.attempt, lease.fencing_token, ItemState.SUCCEEDED, result="{}")
    return Flight(item, lease, item.endpoint, run_plan(item)), finish


def test_the_result_writer_outlives_a_store_outage_and_commits_later(
    settings: Settings, small_repo: Repository, caplog: pytest.LogCaptureFixture
) -> None:
    repo = small_repo
    ledger = Ledger.from_url(settings.redis_url, settings.redis_namespace, pool_policy(settings))
    flight, finish = _running_item(repo, ledger)

    async def scenario() -> NodeDispatcher:
        aledger = AsyncLedger.from_url(
            settings.redis_url, settings.redis_namespace, pool_policy(settings)
        )
        dispatcher = NodeDispatcher(
            DispatchConfig(node="n1", result_flush_s=0.0),
            cast(Engine, None),  # the writer never talks to the engine
            repo,
            aledger,
            model="m",
            block_size=BLOCK,
            max_sequence_tokens=4096,
        )
        dispatcher.state.flights[flight.item.id] = flight
        held = repo.engine.connect()  # Postgres out of reach for the writer
        writer = asyncio.create_task(dispatcher.writer.write_results())
        try:
            await dispatcher.writer.put((finish, flight))
            loop = asyncio.get_running_loop()
            give_up = loop.time() + HANG_S
            while not any("cannot write results" in r.getMessage() for r in caplog.records):
                if writer.done():
                    raise AssertionError(f"the result writer died: {writer.exception()!r}")
                dropped = [r for r in caplog.records if "could not be written" in r.getMessage()]
                assert not dropped, "the writer dropped the results instead of waiting"
                assert loop.time() < give_up, "the writer never tried to write"
                await asyncio.sleep(0.05)
            assert not writer.done()
            assert flight.item.id in dispatcher.state.flights  # still held, still heartbeated
        finally:
            held.close()
        await dispatcher.writer.put(None)
        await asyncio.wait_for(writer, HANG_S)
        await aledger.aclose()
        return dispatcher

    try:
        with caplog.at_level(logging.WARNING, logger="backfill.worker"):
            dispatcher = asyncio.run(scenario())
        assert dispatcher.stats.succeeded == 1
        assert dispatcher.state.flights == {}
        [item] = repo.items.items(flight.item.job_id)
        assert item.state is ItemState.SUCCEEDED
        snap = ledger.snapshot("n1")
        assert snap is not None
        assert snap.batch_in_use == 0  # the lease went back once the result was durable
    finally:
        ledger.close()
