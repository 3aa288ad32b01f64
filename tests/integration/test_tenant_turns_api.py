"""Through the real API: a tenant with its bound of requests in progress (here two creates
whose bodies arrive slowly) queues its further requests, which wait and then get a 429 naming
the bound, while another tenant's read is answered at once; a place freed goes to the
tenant's waiting request.

Each step waits for the edge's own count of requests in progress and waiting (an event), not
for a sleep; the one bound in seconds is the queue's wait, made long here so that a loaded
machine's slow answers cannot pass for the bound."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from urllib.parse import urlsplit

import httpx

from backfill.config import Settings
from queue_api.tenant_turns import TenantTurns
from tests.integration.batch_api_support import Tenant, api_settings, serve

QUEUE_WAIT_S = 6.0
"""The queue's wait in this test (the product's is 2 s)."""

CREATE = {"input_file_id": "file-nothere", "endpoint": "/v1/chat/completions"}
BODY = json.dumps({**CREATE, "completion_window": "24h"}).encode()


@contextmanager
def slow_create(base_url: str, key: str) -> Iterator[socket.socket]:
    """A create whose body has not all arrived: in progress until the rest is sent."""
    parts = urlsplit(base_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    head = (
        f"POST /v1/batches HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    sock.sendall(head + BODY[:10])
    try:
        yield sock
    finally:
        sock.close()


def edge_turns(app: object) -> TenantTurns:
    """The request edge's queues, found down the app's middleware stack."""
    layer = getattr(app, "middleware_stack", None)
    while layer is not None:
        turns = getattr(layer, "turns", None)
        if isinstance(turns, TenantTurns):
            return turns
        layer = getattr(layer, "app", None)
    raise AssertionError("no request edge with tenant turns in the app")


def until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never {what} in {timeout_s:.0f} s"
        time.sleep(0.01)


def _finish(sock: socket.socket) -> bytes:
    sock.sendall(BODY[10:])
    return sock.recv(65536)


def test_a_tenant_past_its_bound_waits_its_turn_and_another_tenant_does_not(
    settings: Settings, acme: Tenant, other: Tenant
) -> None:
    with (
        serve(api_settings(settings, tenant_requests_in_progress=2)) as live,
        httpx.Client(base_url=live.base_url, timeout=30) as http,
        ExitStack() as held,
    ):
        a = {"Authorization": f"Bearer {acme.key}"}
        b = {"Authorization": f"Bearer {other.key}"}
        # Both keys in the key cache: what follows is the bound, not a key lookup.
        assert http.get("/v1/batches", headers=a).status_code == 200
        assert http.get("/v1/batches", headers=b).status_code == 200
        turns = edge_turns(live.app)
        turns.wait_s = QUEUE_WAIT_S
        slow = [held.enter_context(slow_create(live.base_url, acme.key)) for _ in range(2)]
        until(lambda: turns.requests.in_progress(acme.id) == 2, "A's two creates in progress")

        answers: dict[str, tuple[httpx.Response, float]] = {}

        def a_read(name: str) -> None:
            started = time.monotonic()
            with httpx.Client(base_url=live.base_url, timeout=30) as own:
                answer = own.get("/v1/batches", headers=a)
            answers[name] = (answer, time.monotonic() - started)

        refused = threading.Thread(target=a_read, args=("refused",))
        refused.start()
        until(lambda: turns.requests.waiting(acme.id) == 1, "A's third request waiting")
        other_read = http.get("/v1/batches", headers=b)
        assert other_read.status_code == 200
        # Answered while A's request still waited its turn: B did not queue behind A.
        assert turns.requests.waiting(acme.id) == 1, answers
        assert "refused" not in answers, "A's third request was answered while two were held"
        refused.join(60)
        answer, waited = answers["refused"]
        assert answer.status_code == 429, answer.text
        error = answer.json()["error"]
        assert error["code"] == "too_many_requests_in_progress"
        assert "at most 2 at once" in error["message"]
        assert answer.headers["Retry-After"] == "1"
        assert waited >= QUEUE_WAIT_S * 0.9

        # A place freed goes to A's waiting request.
        admitted = threading.Thread(target=a_read, args=("admitted",))
        admitted.start()
        until(lambda: turns.requests.waiting(acme.id) == 1, "A's next request waiting")
        assert "admitted" not in answers
        assert b" 404 " in _finish(slow[0]).split(b"\r\n", 1)[0]
        admitted.join(60)
        answer, waited = answers["admitted"]
        assert answer.status_code == 200, answer.text
        assert waited < QUEUE_WAIT_S
