"""The nodes that serve interactive requests: registered nodes (Postgres) with each engine's
context length, refreshed in the background so no request waits on Postgres after the
first."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from backfill.cancelling import cancel_and_wait
from backfill.engine.protocol import Engine, EngineError
from backfill.errors import BackfillError
from backfill.gateway.refusals import GatewayUnavailable
from backfill.store import NodeRecords

log = logging.getLogger("backfill.gateway")


@dataclass(frozen=True)
class ServingNode:
    name: str
    engine_url: str
    model: str
    max_model_len: int | None
    unanswered: str | None = None
    """Why the engine's context length is unknown: its error when asked (e.g. it refused the
    key), for a caller that needs the length to say more than "not served"."""


class NodeDirectory:
    """Registered nodes with each engine's context length (asked once per engine and model)."""

    def __init__(
        self, repo: NodeRecords, refresh_s: float, engine_for: Callable[[str], Engine]
    ) -> None:
        self._repo = repo
        self._refresh_s = refresh_s
        self._engine_for = engine_for
        self._nodes: list[ServingNode] | None = None
        self._loaded_at = 0.0
        self._refreshing: asyncio.Task[None] | None = None
        self._context: dict[tuple[str, str], int | None] = {}
        self._unanswered: dict[tuple[str, str], str] = {}

    async def serving(self, model: str) -> tuple[list[ServingNode], bool]:
        """Nodes serving ``model``, and whether any node is registered at all."""
        stale = time.monotonic() - self._loaded_at > self._refresh_s
        if self._nodes is None or (stale and not self._nodes):
            await self._refresh()
        elif stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self._refresh())
        nodes = self._nodes or []
        return [n for n in nodes if n.model == model], bool(nodes)

    async def registered(self, name: str) -> bool:
        """Whether a node of that name is registered (serving any model)."""
        await self.serving("")
        return any(n.name == name for n in self._nodes or [])

    async def _refresh(self) -> None:
        try:
            records = await asyncio.to_thread(self._repo.nodes.nodes)
        except BackfillError as exc:
            log.warning("node directory not refreshed: %s", exc)
            if self._nodes is None:
                raise GatewayUnavailable(
                    "the node directory is unavailable", retry_after_s=5.0
                ) from exc
            return
        nodes = []
        for r in records:
            if r.model is None:
                continue
            key = (r.engine_url, r.model)
            if self._context.get(key) is None:
                self._context[key] = await self._context_length(r.engine_url, r.model)
            nodes.append(
                ServingNode(
                    r.name, r.engine_url, r.model, self._context[key], self._unanswered.get(key)
                )
            )
        self._nodes = nodes
        self._loaded_at = time.monotonic()

    async def _context_length(self, url: str, model: str) -> int | None:
        try:
            models = await self._engine_for(url).models()
        except EngineError as exc:
            self._unanswered[(url, model)] = str(exc)
            return None
        self._unanswered.pop((url, model), None)
        return next((x.max_model_len for x in models if x.id == model), None)

    async def aclose(self) -> None:
        if self._refreshing is not None:
            await cancel_and_wait([self._refreshing])  # again if a cancellation was lost
