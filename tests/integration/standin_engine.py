"""An engine stand-in for dispatcher tests over real Postgres and Redis, where the engine's
output is not what is tested: every prompt counts 5 tokens, every request answers one token
at once, and the engine makes progress at every load read (the stall watch stays quiet).
``fail_after`` makes every stream raise an error of the worker's own (not an engine error)
after that many chunks: a fault no real engine can be made to produce."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any

from backfill.capacity import EngineLoad, EnginePool
from backfill.engine.protocol import ChoiceDelta, CompletionStream, ModelInfo, StreamChunk, Usage


class StandInEngine:
    def __init__(self, *, blocks: int = 64, block: int = 16, fail_after: int | None = None):
        self.blocks, self.block = blocks, block
        self.fail_after = fail_after
        self.streamed: list[str] = []
        """Request ids, one per stream started."""
        self._progress = 0

    async def pool(self) -> EnginePool:
        return EnginePool(
            num_blocks=self.blocks, block_size=self.block, capacity_tokens=self.blocks * self.block
        )

    async def load(self) -> EngineLoad:
        self._progress += 1
        return EngineLoad(0.0, 0, 0, 0, 0, self._progress)

    async def models(self) -> list[ModelInfo]:
        return [ModelInfo("m", 512, None)]

    async def tokenize(self, body: Mapping[str, Any], model: str) -> int:
        return 5

    def stream_completion(
        self,
        endpoint: str,
        body: Mapping[str, Any],
        *,
        priority: int,
        request_id: str,
        stream_interval: int = 1,
    ) -> CompletionStream:
        self.streamed.append(request_id)
        fail_after = self.fail_after

        async def chunks() -> AsyncIterator[StreamChunk]:
            answer = [
                StreamChunk("c", (ChoiceDelta(0, "ok", "stop"),), None, {}),
                StreamChunk("c", (), Usage(5, 1, 6), {}),
            ]
            for sent, chunk in enumerate(answer):
                if sent == fail_after:
                    raise RuntimeError("a fault of the worker's own")
                yield chunk

        return CompletionStream(chunks())
