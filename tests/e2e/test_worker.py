"""The node worker against a real vLLM server: jobs complete exactly once, interactive load
preempts batch (which resumes), deadlines expire, cancel and SIGTERM stop in-flight work, and
two workers on one node never over-reserve.

The engine here has a deliberately small KV pool (48 blocks of 128 tokens) so that batch slack
and preemption are exercised with a handful of items.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from backfill import finalize
from backfill.capacity import round_up_to_block
from backfill.config import Settings
from backfill.ledger import Lease, Ledger
from backfill.maintenance import pool_policy, tick
from backfill.states import ItemState, JobState
from backfill.store import NewItem, OpenClaim, Repository, Start
from devkit.enginespeed import EngineSpeed, measure_speed
from tests.e2e import helpers
from tests.e2e.helpers import successes_per_item
from tests.integration.batch_api_support import api_settings, chat_line, jsonl, make_tenant, serve
from worker.node import NodeThread

# A guard against hangs: the waits inside follow the engine's measured speed.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

BLOCKS = 48
BLOCK = 128
CAPACITY = BLOCKS * BLOCK
PROMPT_TOKENS = 16
"""About what the prompts below come to (~10 tokens; chat adds its template)."""
SLOWDOWN = 4
"""How much slower than at the start of the module the engine may get under foreign load."""


@pytest.fixture(scope="module")
def small_engine() -> Iterator[str]:
    yield from helpers.engine_url(
        "tiny", num_gpu_blocks_override=BLOCKS, max_model_len=512, kv_cache_gib=1
    )


@pytest.fixture(scope="module")
def small_engine_speed(small_engine: str) -> EngineSpeed:
    return measure_speed(small_engine, "tiny")


@dataclass
class Deployment:
    settings: Settings
    repo: Repository
    ledger: Ledger
    engine_url: str
    speed: EngineSpeed

    def submit(
        self,
        n: int,
        *,
        endpoint: str = "/v1/completions",
        max_tokens: int = 32,
        deadline_s: float = 3600,
        tag: str = "",
    ) -> str:
        tenant = self.repo.tenants.create_tenant(f"t-{time.monotonic_ns()}")
        f = self.repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
        job = self.repo.jobs.create_job(
            tenant.id, f.id, endpoint, "1h", datetime.now(UTC) + timedelta(seconds=deadline_s)
        )
        items = []
        for i in range(n):
            if endpoint == "/v1/completions":
                body = {
                    "model": "tiny",
                    "prompt": f"{tag} document {i}: the fox",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                }
            else:
                body = {
                    "model": "tiny",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"{tag} summarise {i}"}],
                }
            items.append(NewItem(i, f"req-{i}", json.dumps(body), max_tokens))
        self.repo.ingest.insert_items(job.id, items)
        self.repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        return job.id

    def submit_bodies(self, endpoint: str, bodies: Sequence[dict[str, Any]]) -> str:
        """A job of these request bodies as they are (each declares its max_tokens)."""
        tenant = self.repo.tenants.create_tenant(f"t-{time.monotonic_ns()}")
        f = self.repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
        job = self.repo.jobs.create_job(
            tenant.id, f.id, endpoint, "1h", datetime.now(UTC) + timedelta(hours=1)
        )
        items = [
            NewItem(i, f"req-{i}", json.dumps(body), int(body["max_tokens"]))
            for i, body in enumerate(bodies)
        ]
        self.repo.ingest.insert_items(job.id, items)
        self.repo.jobs.move_job(job.id, JobState.IN_PROGRESS)
        return job.id

    def counts(self, job_id: str) -> dict[ItemState, int]:
        return self.repo.stats.counted_states(job_id)

    def wait(self, cond: Callable[[], bool], timeout: float = 240, what: str = "") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}")

    def job_timeout(self, n: int, max_tokens: int, floor: float = 240) -> float:
        """Seconds to wait for a job of ``n`` items of ``max_tokens`` on this engine: as many
        waves as batch slack holds such items at once, at the engine's measured speed."""
        slack = CAPACITY - pool_policy(self.settings).reserve_tokens(CAPACITY)
        at_once = slack // round_up_to_block(PROMPT_TOKENS + max_tokens, BLOCK)
        expected = self.speed.seconds_for_batch(n, PROMPT_TOKENS, max_tokens, at_once)
        return max(floor, SLOWDOWN * expected)

    def batch_in_use(self, node: str) -> int:
        snap = self.ledger.snapshot(node)
        return 0 if snap is None else snap.batch_in_use

    def successes_per_item(self, job_id: str) -> dict[int, int]:
        return successes_per_item(self.repo, job_id)


@pytest.fixture
def deployment(
    settings: Settings, small_engine: str, small_engine_speed: EngineSpeed
) -> Iterator[Deployment]:
    s = settings.model_copy(
        update={
            "lease_ttl_s": 6.0,
            "heartbeat_interval_s": 1.0,
            "shutdown_grace_s": 3.0,
            "max_in_flight_per_node": 32,
        }
    )
    repo = Repository.connect(s.database_url, pool_size=4)
    ledger = Ledger.from_url(s.redis_url, s.redis_namespace, pool_policy(s), lease_ttl_ms=6000)
    yield Deployment(s, repo, ledger, small_engine, small_engine_speed)
    ledger.close()
    repo.close()


@pytest.fixture
def maintenance(deployment: Deployment) -> Iterator[None]:
    """Beat's job, every 0.5 s, in a thread."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(0.5):
            try:
                tick(deployment.repo, deployment.ledger, deployment.settings)
            except Exception:
                # As under Celery beat, a failed tick is logged and the next one runs.
                logging.getLogger(__name__).exception("maintenance tick failed")

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield
    stop.set()
    t.join(10)


@pytest.fixture
def node(deployment: Deployment) -> Iterator[NodeThread]:
    thread = NodeThread(deployment.settings, "n1", deployment.engine_url)
    thread.start()
    assert thread.started.wait(60), f"node did not start: {thread.error}"
    yield thread
    thread.stop()
    thread.join(30)
    assert thread.error is None


def _assert_exactly_once(d: Deployment, job_id: str, n: int) -> None:
    per_item = d.successes_per_item(job_id)
    assert len(per_item) == n
    assert set(per_item.values()) == {1}, "an item succeeded twice or not at all"
    results = [
        json.loads(i.result or "null")
        for i in d.repo.items.items(job_id, states=[ItemState.SUCCEEDED])
    ]
    assert len(results) == n


def test_a_job_completes_with_one_result_per_line(
    deployment: Deployment, node: NodeThread, maintenance: None
) -> None:
    d = deployment
    chat = d.submit(40, endpoint="/v1/chat/completions", max_tokens=16, tag="chat")
    comp = d.submit(40, endpoint="/v1/completions", max_tokens=16, tag="comp")
    for job_id in (chat, comp):
        d.wait(
            lambda j=job_id: d.repo.jobs.get_job(None, j).state is JobState.COMPLETED,
            what="job completion",
        )
        _assert_exactly_once(d, job_id, 40)
    body = json.loads(d.repo.items.items(chat, states=[ItemState.SUCCEEDED])[0].result or "{}")
    assert body["object"] == "chat.completion"
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["message"]["role"] == "assistant"
    body = json.loads(d.repo.items.items(comp, states=[ItemState.SUCCEEDED])[0].result or "{}")
    assert body["object"] == "text_completion"
    assert body["usage"]["completion_tokens"] == 16
    d.wait(lambda: d.batch_in_use("n1") == 0, 10, "leases released")


# The body fields OpenAI's API reference defines, compared one by one.
_TOP_FIELDS = ("object", "model", "system_fingerprint")
_CHOICE_FIELDS = ("index", "finish_reason", "logprobs")
_MESSAGE_FIELDS = ("role", "content", "tool_calls", "refusal", "function_call")


def test_a_result_body_is_what_the_engine_answers_without_streaming(
    deployment: Deployment, node: NodeThread
) -> None:
    # The worker streams (to see progress, preempt and resume) but must store the body the
    # engine gives a non-streaming request: logprobs, finish_reason, usage and the rest, not
    # only the text. Greedy, one request at a time on either path, so the two compute alike.
    d = deployment
    cases = [
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "Name three colours."}],
                "max_tokens": 12,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
        ),
        (
            "/v1/completions",
            {
                "model": "tiny",
                "prompt": "The fox",
                "max_tokens": 12,
                "temperature": 0,
                "logprobs": 2,
            },
        ),
    ]
    for endpoint, body in cases:
        job = d.submit_bodies(endpoint, [body])
        d.wait(lambda j=job: d.counts(j).get(ItemState.SUCCEEDED, 0) == 1, what=endpoint)
        [item] = d.repo.items.items(job, states=[ItemState.SUCCEEDED])
        ours = json.loads(item.result or "{}")
        direct = httpx.post(f"{d.engine_url}{endpoint}", json=body, timeout=120).json()
        for name in _TOP_FIELDS:
            assert ours[name] == direct[name], (endpoint, name)
        assert ours["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"]
        assert ours["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
        [mine], [theirs] = ours["choices"], direct["choices"]
        for name in _CHOICE_FIELDS:
            if name == "logprobs":
                continue
            assert mine[name] == theirs[name], (endpoint, name)
        if endpoint == "/v1/chat/completions":
            assert set(mine["message"]) == set(theirs["message"])
            for name in _MESSAGE_FIELDS:
                assert mine["message"].get(name) == theirs["message"].get(name), name
            got = [(e["token"], len(e["top_logprobs"])) for e in mine["logprobs"]["content"]]
            want = [(e["token"], len(e["top_logprobs"])) for e in theirs["logprobs"]["content"]]
            assert got == want
        else:
            assert mine["text"] == theirs["text"]
            assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
            assert mine["logprobs"]["text_offset"] == theirs["logprobs"]["text_offset"]
            assert len(mine["logprobs"]["top_logprobs"]) == len(theirs["logprobs"]["top_logprobs"])


def test_batch_never_exceeds_its_slack(deployment: Deployment, node: NodeThread) -> None:
    d = deployment
    job = d.submit(120, max_tokens=200, tag="slack")
    policy = pool_policy(d.settings)
    limit = CAPACITY - policy.reserve_tokens(CAPACITY)
    peak = 0
    end = time.monotonic() + d.job_timeout(120, 200, floor=300)
    while d.counts(job).get(ItemState.SUCCEEDED, 0) < 120:
        # Checked until every item is done, not for a fixed time: on a starved machine the job
        # takes longer, and the exactly-once check below needs all of it.
        if time.monotonic() > end:
            dispatcher = node.dispatchers[0] if node.dispatchers else None
            state = (
                None
                if dispatcher is None
                else (dispatcher.in_flight, dispatcher.work_budget, dispatcher.stats)
            )
            raise AssertionError(
                f"job not done: {d.counts(job)}; ledger {d.ledger.snapshot('n1')}; "
                f"dispatcher (in flight, budget, stats) {state}"
            )
        snap = d.ledger.snapshot("n1")
        assert snap is not None
        peak = max(peak, snap.batch_in_use)
        assert snap.batch_in_use <= limit
        time.sleep(0.05)
    assert peak > limit // 2, f"batch never came near its slack (peak {peak} of {limit})"
    _assert_exactly_once(d, job, 120)


def test_a_tight_prefill_budget_does_not_churn_claims(deployment: Deployment) -> None:
    """The work budget lets only a prompt or two into prefill at once: the dispatcher claims
    what it could start, not a full claim batch that mostly goes back to the queue (each
    round trip of which cost Postgres writes and, before counts were kept, another
    ``/tokenize``: a 240-item job once claimed items 3,320 times)."""
    d = deployment
    s = d.settings.model_copy(
        update={
            "work_budget_floor_prefill_tokens": 24,
            "work_budget_ceiling_prefill_tokens": 24,
            "claim_batch_size": 32,
        }
    )
    thread = NodeThread(s, "n1", d.engine_url)
    thread.start()
    try:
        assert thread.started.wait(60), f"node did not start: {thread.error}"
        job = d.submit(40, max_tokens=24, tag="churn")
        dispatcher = thread.dispatchers[0]
        try:
            d.wait(lambda: d.counts(job).get(ItemState.SUCCEEDED, 0) == 40, 300, "the job")
        except AssertionError:
            raise AssertionError(
                f"job not done under a tight prefill budget: {d.counts(job)}, "
                f"{dispatcher.stats}, budget {dispatcher.work_budget}, "
                f"in flight {dispatcher.in_flight}"
            ) from None
        stats = dispatcher.stats
    finally:
        thread.stop()
        thread.join(30)
    assert thread.error is None
    _assert_exactly_once(d, job, 40)
    # Each prompt is ~10 tokens: two fit the prefill budget. A claim may still come back
    # when a prompt is longer than the typical one; a full batch of 32 coming back each
    # time would claim hundreds.
    assert stats.started == 40
    assert stats.claimed <= 2 * 40, stats


def test_a_lease_preempted_between_reservation_and_start_never_reaches_the_engine(
    deployment: Deployment, node: NodeThread
) -> None:
    """The ledger prefers the newest leases as victims (nothing generated yet), and those are
    exactly the ones whose start is still being written to Postgres when the preemption notice
    comes. The dispatcher must keep that notice and requeue such an item without sending it to
    the engine: it has no reservation any more."""
    d = deployment
    dispatcher = node.dispatchers[0]
    real_start = dispatcher.repo.claims.start_claim
    preempted: list[str] = []
    raced: list[int] = []

    def start_after_a_preemption(
        claim: OpenClaim, starts: Sequence[Start], held: Sequence[tuple[int, int]] = ()
    ) -> list[int]:
        if not raced and starts:
            # Interactive takes the whole pool now: every batch lease is a victim.
            lease = d.ledger.reserve("n1", "interactive", CAPACITY - 1024, 1000)
            assert isinstance(lease, Lease), lease
            preempted.extend(lease.preempted)
            raced.extend(s.item_id for s in starts if s.lease_id in lease.preempted)
            time.sleep(0.5)  # the notice reaches the dispatcher's listener meanwhile
            d.ledger.release(lease)
        return real_start(claim, starts, held)

    # The worker starts its claim in one write: the race sits between the leases it
    # reserved and that start.
    dispatcher.repo.claims.start_claim = start_after_a_preemption  # type: ignore[method-assign]
    try:
        job = d.submit(6, max_tokens=64, tag="early-preempt")
        d.wait(lambda: d.counts(job).get(ItemState.SUCCEEDED, 0) == 6, 180, "all items")
    finally:
        del dispatcher.repo.claims.start_claim
    assert raced, f"the race was not staged (preempted {preempted})"
    _assert_exactly_once(d, job, 6)
    with d.repo.engine.connect() as conn:
        first = conn.execute(
            text(
                "SELECT item_id, outcome, output_tokens FROM attempts "
                "WHERE item_id = ANY(:ids) AND attempt = 1 ORDER BY item_id"
            ),
            {"ids": raced},
        ).all()
    # Preempted before its first engine step: nothing generated, nothing lost.
    assert [(r[1], r[2]) for r in first] == [("preempted", 0)] * len(raced), first
    for item in d.repo.items.items(job, states=[ItemState.SUCCEEDED]):
        if item.id in raced:
            assert item.preemptions == 1


@pytest.mark.parametrize(("endpoint", "n"), [("/v1/completions", 40), ("/v1/chat/completions", 30)])
def test_interactive_burst_preempts_batch_which_resumes_and_completes_once(
    deployment: Deployment, node: NodeThread, endpoint: str, n: int
) -> None:
    d = deployment
    job = d.submit(n, endpoint=endpoint, max_tokens=200, tag=f"preempt{endpoint}")
    d.wait(lambda: d.batch_in_use("n1") > CAPACITY // 2, 240, "batch to fill its slack")
    preempted_total = 0
    for _ in range(3):
        # Interactive needs most of the pool: it may take the room batch holds.
        lease = d.ledger.reserve("n1", "interactive", 3000, 1000)
        assert isinstance(lease, Lease), lease
        preempted_total += len(lease.preempted)
        time.sleep(1.0)
        d.ledger.release(lease)
        time.sleep(1.0)
    assert preempted_total > 0
    d.wait(lambda: d.counts(job).get(ItemState.SUCCEEDED, 0) == n, 180, "all items")
    _assert_exactly_once(d, job, n)
    resumed = [
        i for i in d.repo.items.items(job, states=[ItemState.SUCCEEDED]) if i.preemptions > 0
    ]
    assert resumed, "no preempted item resumed"
    for item in resumed:
        assert item.preemptions <= d.settings.max_preemptions_per_item
        usage = json.loads(item.result or "{}")["usage"]
        # Resumed from its partial output: the whole answer has exactly max_tokens tokens.
        assert usage["completion_tokens"] == 200


def test_deadline_expires_the_job_and_keeps_finished_results(
    deployment: Deployment, node: NodeThread, maintenance: None
) -> None:
    d = deployment
    quick = d.submit(5, max_tokens=8, deadline_s=3600, tag="quick")
    d.wait(lambda: d.repo.jobs.get_job(None, quick).state is JobState.COMPLETED, 240, "quick job")
    # Far more work than fits before a short deadline.
    job = d.submit(400, max_tokens=300, deadline_s=6, tag="late")
    ended = (JobState.EXPIRED, JobState.COMPLETED)
    try:
        d.wait(lambda: d.repo.jobs.get_job(None, job).state in ended, 240, "expiry")
    except AssertionError as exc:
        record = d.repo.jobs.get_job(None, job)
        raise AssertionError(f"{exc}: job {record.state}, items {d.counts(job)}") from None
    counts = d.counts(job)
    assert counts.get(ItemState.SUCCEEDED, 0) + counts.get(ItemState.EXPIRED, 0) == 400
    assert counts.get(ItemState.EXPIRED, 0) > 0
    job_record = d.repo.jobs.get_job(None, job)
    assert job_record.error_file_id is not None
    # Expired at the deadline, or completed before it when every item that could not finish
    # in time was expired early instead of started (OpenAI's meaning: it ended in its window).
    if job_record.state is JobState.COMPLETED:
        completed_at = job_record.timestamps["completed_at"]
        assert completed_at is not None
        assert completed_at <= job_record.deadline
    if counts.get(ItemState.SUCCEEDED, 0):
        assert job_record.output_file_id is not None
    d.wait(lambda: d.batch_in_use("n1") == 0, 60, "leases released after expiry")


def test_cancel_stops_in_flight_items_and_keeps_finished_results(
    deployment: Deployment, node: NodeThread, maintenance: None
) -> None:
    d = deployment
    job = d.submit(200, max_tokens=400, tag="cancel")
    d.wait(lambda: d.counts(job).get(ItemState.RUNNING, 0) > 3, 240, "items running")
    tenant = d.repo.jobs.get_job(None, job).tenant_id
    finalize.cancel_job(d.repo, tenant, job)
    d.wait(lambda: d.repo.jobs.get_job(None, job).state is JobState.CANCELLED, 120, "cancelled")
    counts = d.counts(job)
    assert counts.get(ItemState.RUNNING, 0) == 0
    assert counts.get(ItemState.RESERVED, 0) == 0
    assert counts.get(ItemState.CANCELLED, 0) > 0
    d.wait(lambda: d.batch_in_use("n1") == 0, 60, "leases released after cancel")
    # The engine stops generating for the cancelled items too.
    d.wait(lambda: _engine_running(d.engine_url) == 0, 60, "engine requests aborted")


def test_a_job_submitted_with_the_openai_sdk_completes_through_api_and_worker(
    deployment: Deployment, node: NodeThread, maintenance: None
) -> None:
    d = deployment
    with serve(api_settings(d.settings)) as api:
        tenant = make_tenant(d.repo, "sdk")
        client = api.client(tenant.key)
        lines = [
            chat_line(f"doc-{i}", f"Summarise document {i}.", max_tokens=12, model="tiny")
            for i in range(30)
        ]
        uploaded = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="1h"
        )
        d.wait(
            lambda: client.batches.retrieve(batch.id).status == "completed", 300, "batch completed"
        )
        done = client.batches.retrieve(batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed) == (30, 30)
        assert done.output_file_id is not None
        rows = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in rows) == sorted(f"doc-{i}" for i in range(30))
        for row in rows:
            body = row["response"]["body"]
            assert row["response"]["status_code"] == 200
            assert body["usage"]["completion_tokens"] <= 12
            assert body["choices"][0]["message"]["role"] == "assistant"


def _engine_running(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_two_workers_on_one_node_never_over_reserve(
    deployment: Deployment, maintenance: None
) -> None:
    d = deployment
    job = d.submit(150, max_tokens=150, tag="two")
    threads = [NodeThread(d.settings, "n1", d.engine_url) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for t in threads:
            assert t.started.wait(60), f"node did not start: {t.error}"
        limit = CAPACITY - pool_policy(d.settings).reserve_tokens(CAPACITY)
        timeout = d.job_timeout(150, 150, floor=300)
        end = time.monotonic() + timeout
        while d.counts(job).get(ItemState.SUCCEEDED, 0) < 150:
            assert time.monotonic() < end, f"job not done in {timeout:.0f} s: {d.counts(job)}"
            snap = d.ledger.snapshot("n1")
            assert snap is not None
            assert snap.batch_in_use <= limit
            assert sum(lease.tokens for lease in snap.leases) == snap.reserved
            time.sleep(0.05)
        _assert_exactly_once(d, job, 150)
        # Both served the node (how the work split between them is up to timing).
        assert all(t.dispatchers for t in threads)
        assert sum(t.dispatchers[0].stats.succeeded for t in threads) >= 150
    finally:
        for t in threads:
            t.stop()
        for t in threads:
            t.join(30)


def test_sigterm_requeues_in_flight_work_and_releases_every_lease(
    deployment: Deployment,
) -> None:
    d = deployment
    job = d.submit(150, max_tokens=400, tag="sigterm")
    env = {
        **os.environ,
        "BACKFILL_DATABASE_URL": d.settings.database_url,
        "BACKFILL_REDIS_URL": d.settings.redis_url,
        "BACKFILL_REDIS_NAMESPACE": d.settings.redis_namespace,
        "BACKFILL_LEASE_TTL_S": "6",
        "BACKFILL_HEARTBEAT_INTERVAL_S": "1",
        "BACKFILL_SHUTDOWN_GRACE_S": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "backfill_cli",
        "worker",
        "--node",
        "n1",
        "--engine-url",
        d.engine_url,
        "--beat",
    ]
    log_path = Path(d.settings.redis_namespace + "-worker.log")
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        # Includes the worker process's start: importing it alone took 11 s on this machine
        # at a load average of 11.
        d.wait(lambda: d.counts(job).get(ItemState.RUNNING, 0) > 3, 240, "items running")
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    counts = d.counts(job)
    assert counts.get(ItemState.RUNNING, 0) == 0, counts
    assert counts.get(ItemState.RESERVED, 0) == 0, counts
    assert d.batch_in_use("n1") == 0
    # A new worker finishes the job; every item exactly once.
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        d.wait(
            lambda: d.repo.jobs.get_job(None, job).state is JobState.COMPLETED,
            d.job_timeout(150, 400),
            "completion",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log_path.unlink(missing_ok=True)
    _assert_exactly_once(d, job, 150)
