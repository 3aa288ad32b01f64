"""A pooled connection to an engine is not reused once the engine may be closing it.

vLLM's API server closes a keep-alive connection idle for ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``
(5 s); httpx reuses one idle for up to its ``keepalive_expiry``, 5 s by default. A request sent
just as the server closes fails with a read error although the engine never saw it: a failed
attempt for a batch item, a 502 for an interactive request. The server here answers like an
engine, except that a request arriving on a connection idle for as long as vLLM's keep-alive
(less the ``LATE_S`` a loaded machine's clocks can be apart) has its connection closed
unanswered: the close and the request crossing. The worker's engine client and the
gateway's must open a new connection.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from backfill.config import Settings
from backfill.engine.http import HttpEngine, engine_limits
from backfill.store import Repository
from queue_api.gateway import InteractiveGateway

VLLM_KEEP_ALIVE_S = 5.0
LATE_S = 0.5
"""How late the two sides' clocks run against each other on a loaded machine: a connection the
client sees idle for 4.6 s may be one the server's 5 s timer has already fired on."""
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class ClosingServer:
    """Answers every request ``{}``, keeping the connection; one that comes after the
    connection sat idle ``VLLM_KEEP_ALIVE_S - LATE_S`` has it closed instead (counted)."""

    def __init__(self) -> None:
        self.closed_on_request = 0
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        idle_since = time.monotonic()
        try:
            while (head := await reader.readuntil(b"\r\n\r\n")) is not None:
                length = next(
                    (int(line.split(b":")[1]) for line in head.split(b"\r\n")
                     if line.lower().startswith(b"content-length:")),
                    0,
                )  # fmt: skip
                await reader.readexactly(length)
                if time.monotonic() - idle_since >= VLLM_KEEP_ALIVE_S - LATE_S:
                    self.closed_on_request += 1
                    return
                writer.write(ANSWER)
                await writer.drain()
                idle_since = time.monotonic()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def _served(
    run: Callable[[str], Awaitable[None]],
) -> ClosingServer:
    """``run`` against a fresh :class:`ClosingServer`'s URL; the server, for its counts."""
    server = ClosingServer()
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    async with listening:
        await run(f"http://127.0.0.1:{port}")
    return server


async def _twice_apart(request: Callable[[], Awaitable[None]]) -> None:
    await request()
    await asyncio.sleep(VLLM_KEEP_ALIVE_S - LATE_S / 2)
    await request()  # the second request, as the engine's keep-alive ends


def test_the_worker_s_engine_client_does_not_reuse_a_connection_the_engine_may_close() -> None:
    async def run(url: str) -> None:
        async with HttpEngine(url) as engine:

            async def healthy() -> None:
                assert await engine.health(), "a request failed on a connection being closed"

            await _twice_apart(healthy)

    server = asyncio.run(_served(run))
    assert server.closed_on_request == 0
    assert server.connections == 2


def test_the_gateway_s_engine_client_does_not_reuse_a_connection_the_engine_may_close(
    settings: Settings, repo: Repository
) -> None:
    async def run(url: str) -> None:
        client = InteractiveGateway(settings, repo).client(url)

        async def healthy() -> None:
            (await client.get(f"{url}/health")).raise_for_status()

        try:
            await _twice_apart(healthy)
        finally:
            await client.aclose()

    server = asyncio.run(_served(run))
    assert server.closed_on_request == 0
    assert server.connections == 2


def test_engine_clients_give_up_idle_connections_well_before_vllm_does() -> None:
    expiry = engine_limits(8, 8).keepalive_expiry
    assert expiry is not None
    assert expiry <= VLLM_KEEP_ALIVE_S / 2
