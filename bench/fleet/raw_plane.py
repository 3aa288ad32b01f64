"""The floor ``bench.fleet`` compares Backfill's control plane with: the same calls as bare SQL
statements and bare Redis commands, without Backfill's logic (:class:`RawPlane`).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import redis.asyncio

from backfill.keys import LedgerKeys
from bench.fleet.plane import RESULT, Held, Opened, claim_to_start
from bench.ledger.compare import RAW_RELEASE, RAW_RESERVE


@dataclass(frozen=True, slots=True)
class RawLease:
    lease_id: str
    tokens: int
    node: str


class RawPlane:
    """The floor: the same calls as bare SQL (one statement each, autocommit) and bare Redis
    commands (a two-line Lua reserve and release, HSET/ZADD for settle and heartbeat)."""

    CLAIM = (
        "UPDATE items SET state = 'reserved', node = %s, attempt = attempt + 1, "
        "lease_expires_at = now() + make_interval(secs => %s) WHERE id IN ("
        "SELECT id FROM items WHERE state = 'queued' ORDER BY deadline, id "
        "LIMIT %s FOR UPDATE SKIP LOCKED) "
        "RETURNING id, attempt, prompt_tokens, max_output_tokens, deadline"
    )

    def __init__(
        self,
        libpq: str,
        client: redis.asyncio.Redis,
        keys: LedgerKeys,
        connections: int,
        listen_client: redis.asyncio.Redis | None = None,
    ) -> None:
        # Each subscription holds a connection: not from the calls' bounded pool.
        self._listen_client = listen_client or client
        self._conns: queue.Queue[psycopg.Connection[Any]] = queue.Queue()
        for _ in range(connections):
            self._conns.put(psycopg.connect(libpq, autocommit=True))
        self._client, self._keys = client, keys
        self._reserve = ""
        self._release = ""
        self._ids = itertools.count()

    async def load_scripts(self) -> None:
        self._reserve = await self._client.script_load(RAW_RESERVE)
        self._release = await self._client.script_load(RAW_RELEASE)

    @property
    def client(self) -> redis.asyncio.Redis:
        return self._client

    @property
    def keys(self) -> LedgerKeys:
        return self._keys

    def close(self) -> None:
        while not self._conns.empty():
            self._conns.get().close()

    def _sql(self, query: str, params: Sequence[Any]) -> list[Any]:
        conn = self._conns.get()
        try:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []
        finally:
            self._conns.put(conn)

    async def _run(self, query: str, *params: Any) -> list[Any]:
        return await asyncio.to_thread(self._sql, query, params)

    def _k(self, node: str) -> tuple[str, str]:
        return f"{self._keys.namespace}:raw:{node}:pool", f"{self._keys.namespace}:raw:{node}:l"

    async def claim_to_start(self, node: str, want: int, ttl_s: float, block_size: int) -> Opened:
        return await claim_to_start(self, node, want, ttl_s, block_size)

    async def snapshot(self, node: str) -> int:
        used = await self._client.hget(self._k(node)[0], "used")
        return 10**9 - int(used or 0)

    async def claim(self, node: str, want: int, ttl_s: float) -> list[Held]:
        rows = await self._run(self.CLAIM, node, ttl_s, want)
        return [Held(r[0], r[1], r[2] or 0, r[3], int(r[4].timestamp() * 1000)) for r in rows]

    async def unclaim(self, node: str, held: Sequence[Held]) -> None:
        await self._run(
            "UPDATE items SET state = 'queued' WHERE id = ANY(%s)", [h.item_id for h in held]
        )

    async def reserve_many(self, node: str, held: Sequence[Held]) -> list[Any]:
        pool, leases = self._k(node)
        pipe = self._client.pipeline(transaction=False)
        out = []
        for h in held:
            lease = RawLease(f"r{next(self._ids)}", h.prompt_tokens + h.max_output_tokens, node)
            pipe.evalsha(self._reserve, 2, pool, leases, lease.lease_id, lease.tokens)
            out.append(lease)
        await pipe.execute()
        return out

    async def give_back(self, held: Held) -> None:
        await self._run("UPDATE items SET state = 'deferred' WHERE id = %s", held.item_id)

    async def start_many(
        self, node: str, leased: Sequence[Held], refused: Sequence[Held], ttl_s: float
    ) -> set[int]:
        if not leased:
            return set()
        rows = await self._run(
            "UPDATE items SET state = 'running' WHERE id = ANY(%s) RETURNING id",
            [h.item_id for h in leased],
        )
        return {r[0] for r in rows}

    async def drop(self, node: str) -> None:
        """Nothing is left open: each call is its own statement."""

    async def settle(self, node: str, held: Held, generated: int) -> None:
        await self._client.hset(self._k(node)[1] + ":gen", held.lease.lease_id, generated)

    async def settle_many(self, node: str, progress: Sequence[tuple[Held, int]]) -> None:
        await self._client.hset(
            self._k(node)[1] + ":gen", mapping={h.lease.lease_id: g for h, g in progress}
        )

    async def heartbeat_claims(self, held: Sequence[Held], ttl_s: float) -> set[int]:
        rows = await self._run(
            "UPDATE items SET lease_expires_at = now() + make_interval(secs => %s) "
            "WHERE id = ANY(%s) RETURNING id",
            ttl_s,
            [h.item_id for h in held],
        )
        return {r[0] for r in rows}

    async def heartbeat_leases(self, node: str, held: Sequence[Held], ttl_s: float) -> None:
        expires = time.time() + ttl_s
        await self._client.zadd(
            self._k(node)[1] + ":exp", {h.lease.lease_id: expires for h in held}
        )

    async def finish(self, done: Sequence[tuple[Held, int]]) -> set[int]:
        rows = await self._run(
            "UPDATE items SET state = 'succeeded', result = %s, output_tokens = %s "
            "WHERE id = ANY(%s) RETURNING id",
            RESULT,
            done[0][1],
            [h.item_id for h, _ in done],
        )
        return {r[0] for r in rows}

    async def release(self, held: Sequence[Held]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for h in held:
            pipe.evalsha(self._release, 2, *self._k(h.lease.node), h.lease.lease_id)
        await pipe.execute()

    async def observe(self, node: str) -> None:
        await self.snapshot(node)
        await self._client.hset(self._k(node)[0], "observed", 0)

    async def listen(self, node: str) -> None:
        pubsub = self._listen_client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(f"{self._keys.namespace}:raw:preempt:{node}")
        try:
            while True:
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
