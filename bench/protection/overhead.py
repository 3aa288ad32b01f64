"""What Backfill costs interactive traffic when there is no batch at all, measured in pairs.

Two figures of issue 18, each a ratio of interactive time to first token with nothing else
running: an engine with Backfill's step scheduler against the stock engine (goal <= 1.02x),
and interactive through Backfill (its gateway, with its API and worker running beside the
engine) against straight to the engine (goal <= 1.03x). ``bench.protection`` reports both
too, but from one replay of ~30 requests per scenario, minutes apart, where the baseline
itself moves 10-40% between runs; a 2% effect needs pairs.

- **scheduler**: both engines run at once (one idles while the other serves); each pair sends
  the same prompt (fresh random tokens, so no prefix-cache hits) to the stock engine and to
  the scheduler's engine, one after the other, the order alternating pair by pair.
- **gateway**: one engine with the scheduler; blocks alternate between *straight* (no Backfill
  process running) and *through Backfill* (``backfill api`` and ``backfill worker --beat``
  running beside the engine, requests through the gateway), so the gateway's own path and
  the CPU Backfill's idle processes take from the engine are both in the figure. Each block
  sends the same prompt lengths; a Backfill stack starts fresh for every such block.

Requests are sequential (a short gap between them), prompts of the lengths in ``SHAPES``
(spanning the protection trace's clipped prompts), ``max_tokens`` 8. Ratios are p50 and p99
of one side over the other, and the median of the per-pair (per-shape, per-block) ratios.
The closing figure is the worst of the four p50/p99 ratios, each divided by its goal (ok at
<= 1).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from backfill.engine.http import sse_lines
from bench.common import finish, parser, percentile, table
from bench.stack import BackfillStack
from devkit.devengine import server as devengine

NAME = "interactive_overhead"
SCHEDULER_GOAL = 1.02
GATEWAY_GOAL = 1.03
SHAPES = (100, 300, 600, 1000, 1500)
OUTPUT_TOKENS = 8
GAP_S = 0.2
TOKEN_RANGE = (300, 1_000)


@dataclass
class Side:
    """One side of a comparison: TTFT per request, and the shape of each."""

    name: str
    ttfts: list[float] = field(default_factory=list)
    shapes: list[int] = field(default_factory=list)
    block_starts: list[int] = field(default_factory=list)

    def add(self, shape: int, ttft: float) -> None:
        self.shapes.append(shape)
        self.ttfts.append(ttft)

    def begin_block(self) -> None:
        self.block_starts.append(len(self.ttfts))

    def block_p50s(self) -> list[float]:
        """The median TTFT of each block, in the order the blocks ran (a drift or one loaded
        block shows here, where the pooled percentiles hide it)."""
        starts = self.block_starts or [0]
        ends = [*starts[1:], len(self.ttfts)]
        return [
            round(statistics.median(self.ttfts[a:b]), 4)
            for a, b in zip(starts, ends, strict=True)
            if b > a
        ]

    def p(self, q: float) -> float:
        return percentile(self.ttfts, q)


@dataclass(frozen=True)
class Comparison:
    name: str
    base: Side
    other: Side
    goal: float

    def ratio(self, q: float) -> float:
        return self.other.p(q) / self.base.p(q)

    def paired(self) -> float:
        """Median of other/base over the requests in the same position (same shape)."""
        return statistics.median(
            o / b for o, b in zip(self.other.ttfts, self.base.ttfts, strict=True) if b > 0
        )

    def worst_share(self) -> float:
        return max(self.ratio(50), self.ratio(99)) / self.goal

    def summary(self) -> dict[str, Any]:
        return {
            "goal": self.goal,
            "requests_per_side": len(self.base.ttfts),
            self.base.name: {"p50": self.base.p(50), "p99": self.base.p(99)},
            self.other.name: {"p50": self.other.p(50), "p99": self.other.p(99)},
            "p50_ratio": self.ratio(50),
            "p99_ratio": self.ratio(99),
            "paired_median_ratio": self.paired(),
            "block_p50s": {side.name: side.block_p50s() for side in (self.base, self.other)},
        }


class Client:
    """Sequential streamed completions; every prompt fresh random token ids."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(120.0))

    def prompt(self, tokens: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_RANGE) for _ in range(tokens)]

    async def ttft(
        self,
        base_url: str,
        model: str,
        prompt: Sequence[int],
        headers: Mapping[str, str] | None = None,
        priority: int | None = 0,
    ) -> float:
        body: dict[str, Any] = {
            "model": model,
            "prompt": list(prompt),
            "max_tokens": OUTPUT_TOKENS,
            "min_tokens": OUTPUT_TOKENS,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        if priority is not None:
            body["priority"] = priority
        sent = time.monotonic()
        first: float | None = None
        async with self.http.stream(
            "POST", f"{base_url}/v1/completions", json=body, headers=headers or {}
        ) as resp:
            resp.raise_for_status()
            async for line in sse_lines(resp):
                data = line.startswith("data: ") and line != "data: [DONE]"
                if first is None and data and json.loads(line[6:]).get("choices"):
                    first = time.monotonic()
        if first is None:
            raise RuntimeError(f"{base_url}: a stream with no tokens")
        await asyncio.sleep(GAP_S)
        return first - sent

    async def aclose(self) -> None:
        await self.http.aclose()


def _shapes(per_block: int, rng: random.Random) -> list[int]:
    shapes = [SHAPES[i % len(SHAPES)] for i in range(per_block)]
    rng.shuffle(shapes)
    return shapes


async def _warm(client: Client, url: str, model: str) -> None:
    for n in (64, 512, 1500, 64):
        await client.ttft(url, model, client.prompt(n))


async def scheduler_pairs(
    stock: devengine.EngineServer, ours: devengine.EngineServer, rounds: int, per_block: int
) -> Comparison:
    client = Client(seed=1)
    base, other = Side("stock"), Side("scheduler")
    try:
        for server in (stock, ours):
            await _warm(client, server.url, server.served_model_name)
        for i, shape in enumerate(_shapes(rounds * per_block, client.rng)):
            if i % per_block == 0:
                base.begin_block()
                other.begin_block()
            prompt = client.prompt(shape)
            order = [(stock, base), (ours, other)]
            for server, side in order if i % 2 == 0 else order[::-1]:
                side.add(shape, await client.ttft(server.url, server.served_model_name, prompt))
    finally:
        await client.aclose()
    return Comparison("scheduler", base, other, SCHEDULER_GOAL)


def gateway_blocks(
    ours: devengine.EngineServer, rounds: int, per_block: int, logs: Path
) -> Comparison:
    base, other = Side("straight"), Side("gateway")
    overrides = {"engine_scheduler_metrics_url": ours.scheduler_metrics_url or ""}
    rng = random.Random(2)
    for r in range(rounds):
        shapes = _shapes(per_block, rng)
        for through in (False, True) if r % 2 == 0 else (True, False):
            seed = 100 + 2 * r + through
            if not through:
                asyncio.run(_block(seed, shapes, base, ours.url, ours.served_model_name))
                continue
            stack = BackfillStack(ours.url, logs / f"round{r}", overrides=overrides)
            with stack.running():
                # The worker's first reads of the engine and its scheduler are over before
                # the block starts; what is left is its steady idle work.
                time.sleep(5)
                block = _block(
                    seed, shapes, other, stack.base, ours.served_model_name, stack.auth, None
                )
                asyncio.run(block)
    return Comparison("gateway", base, other, GATEWAY_GOAL)


async def _block(
    seed: int,
    shapes: Sequence[int],
    side: Side,
    url: str,
    model: str,
    headers: Mapping[str, str] | None = None,
    priority: int | None = 0,
) -> None:
    """One block of sequential requests (after one to warm the connection)."""
    client = Client(seed)
    try:
        await client.ttft(url, model, client.prompt(64), headers, priority)
        side.begin_block()
        for shape in shapes:
            side.add(shape, await client.ttft(url, model, client.prompt(shape), headers, priority))
    finally:
        await client.aclose()


def _rows(comparisons: Sequence[Comparison]) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for c in comparisons:
        for side in (c.base, c.other):
            by_shape = {
                s: statistics.median(
                    t for sh, t in zip(side.shapes, side.ttfts, strict=True) if sh == s
                )
                for s in SHAPES
                if s in side.shapes
            }
            rows.append(
                [c.name, side.name, len(side.ttfts), side.p(50), side.p(99)]
                + [by_shape.get(s, float("nan")) for s in SHAPES]
            )
        rows.append(
            [c.name, "ratio", "", c.ratio(50), c.ratio(99), f"paired median {c.paired():.3f}"]
            + [""] * (len(SHAPES) - 1)
        )
    return rows


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=None, help="blocks per side (default 4)")
    p.add_argument("--per-block", type=int, default=None, help="requests per block (30)")
    p.add_argument(
        "--only",
        choices=("scheduler", "gateway"),
        default=None,
        help="one of the two figures (the verdict is then on it alone)",
    )
    args = p.parse_args()
    rounds = args.rounds or (2 if args.quick else 4)
    per_block = args.per_block or (10 if args.quick else 30)
    logs = Path(tempfile.mkdtemp(prefix="bf-overhead-"))
    comparisons: list[Comparison] = []
    ours = devengine.start_model(args.model, scheduler=True)
    try:
        if args.only != "gateway":
            stock = devengine.start_model(args.model)
            try:
                comparisons.append(asyncio.run(scheduler_pairs(stock, ours, rounds, per_block)))
            finally:
                stock.stop()
        if args.only != "scheduler":
            comparisons.append(gateway_blocks(ours, rounds, per_block, logs))
    finally:
        ours.stop()
    headers = ["figure", "side", "n", "p50 s", "p99 s"] + [f"{s} tok p50" for s in SHAPES]
    print(table(headers, _rows(comparisons)))
    worst = max(c.worst_share() for c in comparisons)
    finish(
        NAME,
        "worst_goal_share",
        round(worst, 3),
        "<=",
        1.0,
        {c.name: c.summary() for c in comparisons} | {"shapes": SHAPES, "logs": str(logs)},
    )


if __name__ == "__main__":
    main()
