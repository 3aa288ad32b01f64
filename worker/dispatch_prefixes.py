"""A node's dispatcher looks for the shared prompt prefixes of its model's jobs (issue 36).

Token ids exist only on an engine (``backfill.prefix_pass`` says why), so a worker finds a
job's prefixes: it takes a job of its model nobody looked at yet, asks its engine for each
unfinished item's token ids, and records each grouped item's prefix. Until then an item
reserves its whole prompt, as without prefixes, so this node's claims leave a new job's items
until its pass has ended, for ``prefix_pass_hold_s`` at most (``prefix_claim_hold_s``). Off
where the engine does not cache prefixes (nothing would be shared) or does not answer token
ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from backfill.prefill import PromptCount
from backfill.prefix_pass import PrefixJobs, PromptTokenIds, find_job_prefixes
from backfill.store.prefixes import PrefixJob
from backfill.work_bell import ring_from
from worker.dispatch_check import Checker
from worker.dispatch_state import DispatcherState

log = logging.getLogger("backfill.worker")

PREFIX_POLL_S = 2.0
"""How often an idle prefix finder asks for a job to look at, unless woken sooner: by the
work bell when a job of its model goes in progress (``backfill.work_bell``; the pass then
starts at once), or by a claim that came back empty (it may have left a new job's items for
its pass; the finder then asks at the claim loop's idle poll)."""


class PrefixFinding:
    """The dispatcher's prefix finder (a helper task of ``NodeDispatcher.run``): the counts
    its passes learn go to ``checker``, so the items are not counted again when claimed."""

    def __init__(
        self, state: DispatcherState, checker: Checker, prefix_jobs: PrefixJobs | None = None
    ) -> None:
        self.state = state
        self.checker = checker
        self.prefix_jobs = prefix_jobs
        # Set when a claim came back empty: a new job's items may wait for its pass.
        self._look = asyncio.Event()

    def look(self) -> None:
        """Ask for a job to look at now, not at the next poll (a claim came back empty)."""
        self._look.set()

    def finds_prefixes(self) -> bool:
        return (
            self.state.config.prefix_caching
            and self.prefix_jobs is not None
            and isinstance(self.state.engine, PromptTokenIds)
        )

    async def find_prefixes(self) -> None:
        store = self.prefix_jobs
        engine = self.state.engine
        assert store is not None
        assert isinstance(engine, PromptTokenIds)
        self._look = asyncio.Event()  # this run's (an event waited on keeps its loop)
        while True:
            job: PrefixJob | None = None
            self._look.clear()  # a wake from here on asks again
            try:
                job = await asyncio.to_thread(store.take_prefix_job, [self.state.model])
                if job is not None:
                    await find_job_prefixes(
                        engine,
                        store,
                        job.job_id,
                        endpoint=job.endpoint,
                        model=job.model,
                        tenant_id=job.tenant_id,
                        block_size=self.state.block_size,
                        concurrency=self.state.config.tokenize_concurrency,
                        counted=self._counted_by_pass,
                        # A page's items are claimable once it is recorded: claim them now.
                        paged=self.state.room.set,
                    )
                    # Its items are claimable now (``prefix_claim_hold_s``): the claim loop,
                    # idle while they were held, is woken rather than left to its next poll,
                    # and so are the other nodes' (``backfill.work_bell``).
                    self.state.room.set()
                    ledger = self.state.ledger
                    await ring_from(ledger.client, ledger.keys, job.model)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # its items reserve their whole prompts: safe, no gain
                log.warning(
                    "node %s: prefixes of batch %s not found: %s",
                    self.state.config.node,
                    job.job_id if job is not None else "?",
                    exc,
                )
                if job is not None:
                    await self._end_prefix_pass(store, job.job_id)
            if job is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._look.wait(), PREFIX_POLL_S)

    def _counted_by_pass(self, item_id: int, tokens: int) -> None:
        """The pass asked for the item's token ids: their number is its count (one prompt,
        one sequence: ``backfill.prefix_pass.prefix_body``)."""
        self.checker.remember_count(item_id, PromptCount.single(tokens))

    async def _end_prefix_pass(self, store: PrefixJobs, job_id: str) -> None:
        """The pass over ``job_id`` failed (one that found ends with its record): claims stop
        leaving its items. If this write fails too, they wait out the hold's bound."""
        try:
            await asyncio.to_thread(store.end_prefix_pass, job_id)
        except Exception as exc:
            log.warning(
                "node %s: prefix pass of batch %s not marked ended: %s",
                self.state.config.node,
                job_id,
                exc,
            )
            return
        self.state.room.set()  # its items are claimable now
