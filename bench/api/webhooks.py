"""Webhook deliveries to well-behaved endpoints beside endpoints that drip their answers.

One sender (``backfill.webhooks.delivery.Sender``, run continuously, default settings but
for private targets allowed) over a scratch database. Ten tenants have ten endpoints each at
a local receiver that answers at once (100 endpoints); ten more tenants have one endpoint each
that reads the request and then answers a byte every 0.25 s, so every attempt runs to the
sender's deadline (``BACKFILL_WEBHOOKS_TIMEOUT_S``, 10 s). Events are written as batch ends
write them (``enqueue_batch_event``), a round of one event per well-behaved tenant every
``--every`` seconds. A delivery's delay is from its event's commit to the receiver's read of
it. Measured twice in the same run: the well-behaved endpoints alone, then with the dripping
endpoints' events (three each) written first. Figure: the well-behaved endpoints' p99 delay
beside the dripping ones over alone; goal <= 1.5.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from sqlalchemy import create_engine

from backfill.config import Settings
from backfill.states import JobState
from backfill.store import Repository
from backfill.webhooks.delivery import Sender
from backfill.webhooks.endpoints import add_endpoint
from backfill.webhooks.outbox import enqueue_batch_event
from backfill.webhooks.store import WebhookStore
from bench.common import finish, parser, percentile, scratch_database, table

NAME = "webhooks"
GOAL = 1.5
TENANTS = 10
ENDPOINTS_PER_TENANT = 10
DRIPPING = 10


class Arrivals:
    """When each event's deliveries reached the receiver (event id -> read times)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.at: dict[str, list[float]] = {}

    def add(self, event_id: str) -> None:
        now = time.time()
        with self.lock:
            self.at.setdefault(event_id, []).append(now)


@contextlib.contextmanager
def receiver(arrivals: Arrivals) -> Iterator[int]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            arrivals.add(json.loads(body)["id"])
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    class Server(ThreadingHTTPServer):
        # The sender opens up to 64 connections at once: the default backlog of 5 refused
        # some, and their retries (5 s later) were counted as the sender's delay.
        request_queue_size = 1024
        daemon_threads = True

    server = Server(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def dripping() -> Iterator[int]:
    """Reads a request, then answers a byte every 0.25 s (never within a deadline)."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\n" + b"x-drip: y\r\n" * 400:
                if stop.is_set():
                    return
                conn.sendall(bytes([byte]))
                time.sleep(0.25)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                conn, _ = listener.accept()
                threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        listener.close()


def write_event(store: WebhookStore, job_id: str) -> str:
    """A batch end's event, as ``move_job`` writes it; returns the event's id."""
    with store.engine.begin() as conn:
        enqueue_batch_event(conn, job_id, JobState.COMPLETED)
        event_id = conn.exec_driver_sql(
            "SELECT id FROM webhook_events WHERE job_id = %(j)s ORDER BY created_at DESC LIMIT 1",
            {"j": job_id},
        ).scalar_one()
    return str(event_id)


def phase(
    store: WebhookStore,
    well_jobs: list[str],
    drip_jobs: list[str],
    arrivals: Arrivals,
    rounds: int,
    every_s: float,
) -> list[float]:
    """The well-behaved deliveries' delays (s) of ``rounds`` rounds, after the dripping
    endpoints' events."""
    for job in drip_jobs:
        for _ in range(3):
            write_event(store, job)
    written: dict[str, float] = {}
    for _ in range(rounds):
        for job in well_jobs:
            event = write_event(store, job)
            written[event] = time.time()
        time.sleep(every_s)
    expected = len(written) * ENDPOINTS_PER_TENANT
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with arrivals.lock:
            got = sum(len(arrivals.at.get(e, ())) for e in written)
        if got >= expected:
            break
        time.sleep(0.1)
    with arrivals.lock:
        return [t - written[e] for e in written for t in arrivals.at.get(e, ())]


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--every", type=float, default=0.5, help="seconds between rounds of events")
    args = p.parse_args()
    rounds = 6 if args.quick else 30
    results: dict[str, list[float]] = {}
    arrivals = Arrivals()
    with (
        scratch_database("bfbench_hooks") as url,
        receiver(arrivals) as port,
        dripping() as drip_port,
    ):
        settings = Settings(database_url=url, webhooks_allow_private=True)
        repo = Repository.connect(url)
        engine = create_engine(url, pool_size=4, max_overflow=4)
        store = WebhookStore(engine)
        tag = secrets.token_hex(3)

        def tenant_job(name: str) -> tuple[str, str]:
            tenant = repo.tenants.create_tenant(f"{name}-{tag}")
            job = repo.jobs.create_job(
                tenant.id, "file-none", "/v1/chat/completions", "24h", repo.now()
            )
            return tenant.id, job.id

        well_jobs, drip_jobs = [], []
        for t in range(TENANTS):
            tenant_id, job_id = tenant_job(f"well{t}")
            for e in range(ENDPOINTS_PER_TENANT):
                add_endpoint(store, settings, tenant_id, url=f"http://127.0.0.1:{port}/{t}/{e}")
            well_jobs.append(job_id)
        for d in range(DRIPPING):
            tenant_id, job_id = tenant_job(f"drip{d}")
            add_endpoint(store, settings, tenant_id, url=f"http://127.0.0.1:{drip_port}/{d}")
            drip_jobs.append(job_id)
        stop = threading.Event()
        sender = Sender(store, settings)
        thread = threading.Thread(target=sender.run, args=(stop,), daemon=True)
        thread.start()
        try:
            results["alone"] = phase(store, well_jobs, [], arrivals, rounds, args.every)
            results["beside 10 dripping"] = phase(
                store, well_jobs, drip_jobs, arrivals, rounds, args.every
            )
        finally:
            stop.set()
            thread.join(60)
            sender.close()
            engine.dispose()
            repo.close()
    rows = [
        (
            side,
            len(delays),
            percentile(delays, 50) * 1000,
            percentile(delays, 99) * 1000,
            max(delays) * 1000,
        )
        for side, delays in results.items()
    ]
    print(table(["side", "deliveries", "p50 ms", "p99 ms", "max ms"], rows))
    expected = rounds * TENANTS * ENDPOINTS_PER_TENANT
    ratio = percentile(results["beside 10 dripping"], 99) / percentile(results["alone"], 99)
    details = {side: {"n": len(d), "p99_s": percentile(d, 99)} for side, d in results.items()}
    whole = all(len(d) == expected for d in results.values())
    finish(NAME, "p99_delay_ratio", ratio, "<=", GOAL, details, holds=whole)


if __name__ == "__main__":
    main()
