"""The check of a node's dispatcher: each claimed item's prompt counted exactly with the
engine's own tokenizer, judged against the batch class limit and its deadline before any
prefill (``backfill.dispatch.judge``), and, for those refused, what becomes of them written
once the claim has started."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from typing import Any

from backfill.dispatch import (
    CheckedItem,
    EngineAbsent,
    Expire,
    Fail,
    GiveBack,
    Limits,
    fit_output,
    judge,
    over_limit,
    run_output,
)
from backfill.engine.protocol import count_prefill
from backfill.errors import StaleWrite
from backfill.prefill import PromptCount, prefill_plan
from backfill.states import ItemState
from backfill.store import ClaimedItem
from worker.dispatch_state import DispatcherState
from worker.prepare import run_plan

COUNTED_KEPT = 65_536
"""Prompt token counts a dispatcher remembers (item id -> tokens), so an item given back
unstarted, or one its prefix pass asked the token ids of, is not counted again when it is
claimed."""

Refused = tuple[ClaimedItem, GiveBack | Fail | Expire]
"""A claimed item that does not start, and what becomes of it."""


class Checker:
    """Counts and judges a claim's items, and settles those it refused."""

    def __init__(self, state: DispatcherState) -> None:
        self.state = state
        # Prompt token counts by item id: an item given back unstarted (no slack, work budget
        # full) is not counted again by the engine when it is claimed again. Bodies never
        # change, so a count stays right; bounded, oldest forgotten first.
        self.counted: OrderedDict[int, PromptCount] = OrderedDict()
        self._tokenize_slots = asyncio.Semaphore(state.config.tokenize_concurrency)

    async def check(
        self, claimed: list[ClaimedItem], claiming: float | None = None
    ) -> tuple[list[CheckedItem], list[Refused]]:
        """Exact prompt tokens of what each item will run, class limit and deadline, before
        any engine work: the items ready to reserve, and those refused with what becomes of
        each (settled after the claim's start: their rows are locked until then). Deadlines
        are judged on Postgres' clock: the time left at the claim (asked at ``claiming``,
        monotonic; now if not given) less the time counting took."""
        state = self.state
        if claiming is None:
            claiming = time.monotonic()
        counted = await asyncio.gather(*(self._prepare(c) for c in claimed), return_exceptions=True)
        limits = Limits(
            max_sequence_tokens=state.max_sequence_tokens,
            max_attempts=state.config.max_attempts,
            prefill_tokens_per_s=state.config.prefill_tokens_per_s,
            decode_tokens_per_s=state.decode_rate,
        )
        ready: list[CheckedItem] = []
        refused: list[Refused] = []
        for item, outcome in zip(claimed, counted, strict=True):
            if isinstance(outcome, asyncio.CancelledError):
                raise outcome
            left_s = item.deadline_left_s - (time.monotonic() - claiming)
            verdict = judge(item, outcome, limits, left_s)
            if isinstance(verdict, CheckedItem):
                ready.append(verdict)
            elif isinstance(verdict, EngineAbsent):
                state.engine_down = True
                refused.append((item, verdict.give_back))
            else:
                refused.append((item, verdict))
        return ready, refused

    async def _prepare(self, item: ClaimedItem) -> CheckedItem:
        """Decide what ``item`` runs and count it exactly; a line that gave no output budget
        gets what the class limit leaves the count (``fit_output``). A continuation the class
        limit would refuse (its re-tokenized partial output came out longer) runs from the
        start."""
        limit = self.state.max_sequence_tokens
        run = run_plan(item)
        original = None if run.kept else await self._count_original(item, run.request)
        count = original or await self._count(run.request, item.endpoint)
        run = fit_output(item, run, count, limit)
        if run.kept and not run.complete:
            fitted = run.max_output is not None
            if over_limit(count, run_output(item, run), limit, fitted=fitted) is not None:
                run = run_plan(item, from_start=True)
                original = count = await self._count_original(item, run.request)
                run = fit_output(item, run, count, limit)
        prompt_tokens = (
            original.total
            if original is not None
            else item.prompt_tokens or max(count.total - run.kept, 0)
        )
        return CheckedItem(item, run, count, prompt_tokens)

    async def _count_original(self, item: ClaimedItem, body: dict[str, Any]) -> PromptCount:
        """The count of an item's own request: stored by an earlier attempt (one sequence)
        or remembered from an earlier claim, else asked of the engine."""
        known = self.counted.get(item.id)
        if known is not None:
            return known
        # Postgres keeps one number, which is the whole count only for one sequence.
        if item.prompt_tokens is not None and prefill_plan(item.endpoint, body).sequences == 1:
            count = PromptCount.single(item.prompt_tokens)
        else:
            count = await self._count(body, item.endpoint)
        self.remember_count(item.id, count)
        return count

    async def _count(self, body: dict[str, Any], endpoint: str) -> PromptCount:
        state = self.state
        plan = prefill_plan(endpoint, body)
        async with self._tokenize_slots:
            return await count_prefill(state.engine, plan, state.model or str(body.get("model")))

    def remember_count(self, item_id: int, count: PromptCount) -> None:
        """``item_id``'s own request counts ``count`` (bodies never change, so it stays
        right); the oldest counts are forgotten past :data:`COUNTED_KEPT`."""
        self.counted[item_id] = count
        if len(self.counted) > COUNTED_KEPT:
            self.counted.popitem(last=False)

    async def settle(self, item: ClaimedItem, outcome: GiveBack | Fail | Expire) -> None:
        """Write what becomes of a claimed item that does not start (fenced by its attempt:
        nothing to do if its claim moved on meanwhile)."""
        repo, stats = self.state.repo, self.state.stats
        if isinstance(outcome, Expire):
            with contextlib.suppress(StaleWrite):
                await asyncio.to_thread(
                    repo.items.expire_claimed, item.id, item.attempt, outcome.reason
                )
            stats.expired += 1
            return
        if isinstance(outcome, Fail):
            with contextlib.suppress(StaleWrite):
                await asyncio.to_thread(repo.items.fail, item.id, item.attempt, outcome.error)
            stats.failed += 1
            return
        with contextlib.suppress(StaleWrite):
            await asyncio.to_thread(
                repo.items.give_back,
                item.id,
                item.attempt,
                outcome.state,
                retry_after_s=outcome.retry_after_s or None,
                detail=outcome.detail,
            )
        if outcome.state is ItemState.DEFERRED:
            stats.deferred += 1
