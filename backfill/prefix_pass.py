"""A job's shared prompt prefixes found and recorded (issue 36).

Token ids are not at hand at ingest: the API and the ingest processes have no tokenizer (the
core imports no vLLM, nor a tokenizer library), and a prompt is counted only on an engine,
through its ``/tokenize`` (``backfill.prefill``), which renders the chat template exactly as
the engine will. ``/tokenize`` answers the token ids with the count, so this pass asks an
engine serving the job's model for each unfinished item's ids (the same ``/tokenize`` body the
count sends), groups them (:class:`backfill.prefixes.PrefixFinder`) and writes the grouped
items' prefixes a page at a time (one statement a page), so the claims of a big batch start
after its first page, not its last. Until it has run, or for an item it leaves out, an item
reserves as it always did: the pass can only make a reservation smaller where it is sure.

Left out (they reserve their whole prompt): embeddings (not salted, and they hold their
prompt alone), requests of more than one prompt or sequence, and an item whose body the
counting plan refuses (the worker fails it with that error when it claims it).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from backfill.prefill import EMBEDDINGS, prefill_plan
from backfill.prefixes import PrefixFinder, SharedPrefix
from backfill.refusals import InvalidRequest
from backfill.store.prefixes import PrefixJob

log = logging.getLogger("backfill.prefixes")

PAGE = 500
"""Items a page of the pass looks at, at most (one statement records a page)."""

FIRST_PAGE = 16
"""Items the pass's first page looks at; each page after is twice the one before, up to
:data:`PAGE`. Claims take the items a page recorded as it ends, so the first claims of a
job wait for this many token ids, not a whole page's (48 items' took 0.67 s on the CPU
engine ``bench.prefix`` runs, during which the job had nothing running)."""

CONCURRENCY = 8
"""Token ids asked of the engine at once when the caller does not say (a worker passes its
dispatcher's ``tokenize_concurrency``): a claim leaves a new job's items until the pass has
ended, so its length is time the job waits (one at a time, 48 prompts took seconds on a busy
CPU engine)."""


@runtime_checkable
class PromptTokenIds(Protocol):
    """An engine that answers a ``/tokenize`` body's token ids."""

    async def tokenize_ids(self, body: Mapping[str, Any], model: str) -> list[int]: ...


class PrefixStore(Protocol):
    def unseen_prefix_items(
        self, job_id: str, *, after_id: int = ..., limit: int = ...
    ) -> list[tuple[int, str]]: ...

    def record_prefixes(
        self,
        job_id: str,
        found: list[tuple[int, str, int]],
        *,
        upto: int | None = ...,
        ended: bool = ...,
    ) -> list[int]: ...


class PrefixJobs(PrefixStore, Protocol):
    """A worker's side: a job taken to look for its prefixes, then the pass."""

    def take_prefix_job(self, models: Sequence[str]) -> PrefixJob | None: ...

    def end_prefix_pass(self, job_id: str) -> None: ...


def prefix_body(endpoint: str, body: Mapping[str, Any]) -> dict[str, Any] | None:
    """The one ``/tokenize`` body whose ids are the item's prompt, or None where the item
    cannot share a prefix (an embedding, several prompts or sequences, an uncountable body)."""
    if endpoint == EMBEDDINGS:
        return None
    try:
        plan = prefill_plan(endpoint, body)
    except InvalidRequest:
        return None
    if plan.known or len(plan.tokenize) != 1 or plan.n != 1:
        return None
    return plan.tokenize[0]


@dataclass(frozen=True, slots=True)
class PrefixesFound:
    looked_at: int
    grouped: int
    recorded: int
    groups: int


async def find_job_prefixes(
    engine: PromptTokenIds,
    store: PrefixStore,
    job_id: str,
    *,
    endpoint: str,
    model: str,
    tenant_id: str,
    block_size: int,
    page: int = PAGE,
    first_page: int = FIRST_PAGE,
    concurrency: int = CONCURRENCY,
    counted: Callable[[int, int], None] | None = None,
    paged: Callable[[], None] | None = None,
) -> PrefixesFound:
    """Find and record the prefixes of job ``job_id``'s unfinished items not yet looked at,
    asking the engine for up to ``concurrency`` items' token ids at once, and recording what
    each page grouped as the page ends (pages of ``first_page`` items, then twice that, up to
    ``page``): claims take the items each record reaches, and all of them once the pass ends.

    ``counted(item_id, tokens)`` is told each item's prompt tokens as the ids came: the body
    asked is the one the counting plan sends for the item (``prefix_body``), so its ids are
    the item's exact count, and a worker that remembers it does not ask its engine to count
    the item again when it claims it (48 ``/tokenize`` calls a claim of the bench's job made
    on the engine it was filling). ``paged()`` is told each page's record: its items are
    claimable now (a worker wakes its claim loop)."""
    finder: PrefixFinder[int] = PrefixFinder(block_size, scope=tenant_id, model=model)
    slots = asyncio.Semaphore(max(1, concurrency))

    async def token_ids(request: Mapping[str, Any]) -> list[int]:
        async with slots:
            return await engine.tokenize_ids(request, model)

    after = 0
    looked_at = 0
    recorded = _Recorded()
    written = 0
    size = max(1, min(first_page, page))
    while True:
        rows = await asyncio.to_thread(
            store.unseen_prefix_items, job_id, after_id=after, limit=size
        )
        if not rows:
            break
        size = min(page, size * 2)
        asked: list[tuple[int, Mapping[str, Any]]] = []
        for item_id, raw in rows:
            looked_at += 1
            try:
                parsed = json.loads(raw)
            except ValueError:
                continue
            request = prefix_body(endpoint, parsed) if isinstance(parsed, dict) else None
            if request is not None:
                asked.append((item_id, request))
        ids = await asyncio.gather(*(token_ids(request) for _, request in asked))
        for (item_id, _), item_ids in zip(asked, ids, strict=True):
            finder.add(item_id, item_ids)
            if counted is not None:
                counted(item_id, len(item_ids))
        after = rows[-1][0]
        written += await _record_page(store, job_id, finder, recorded, after)
        if paged is not None:
            paged()
    # Every item looked at (or none to look at): claims take all of the job's items.
    await asyncio.to_thread(store.record_prefixes, job_id, [], ended=True)
    groups = len({p.id for p in recorded.prefixes.values()})
    log.info(
        "prefixes: batch %s: %d items looked at, %d in %d shared prefixes",
        job_id,
        looked_at,
        written,
        groups,
    )
    return PrefixesFound(looked_at, len(recorded.prefixes), written, groups)


@dataclass(slots=True)
class _Recorded:
    """What a pass has recorded so far."""

    prefixes: dict[int, SharedPrefix] = field(default_factory=dict)


async def _record_page(
    store: PrefixStore,
    job_id: str,
    finder: PrefixFinder[int],
    recorded: _Recorded,
    upto: int,
) -> int:
    """Record the grouped items not recorded yet, and that the pass has looked up to item
    ``upto``, as a page of the pass ends; how many were written. Claims take the job's items
    up to there, so the claims of a big batch start after its first page, not after its last,
    behind the pass, which records each page as it goes.

    An item keeps the prefix it was recorded with: one that a later page's items share less
    of is a group of its own (each reserved once per node; the blocks the two physically
    share are then reserved twice, never too few)."""
    known = recorded.prefixes
    new = sorted((item, shared) for item, shared in finder.found().items() if item not in known)
    rows = [(item, shared.id, shared.blocks) for item, shared in new]
    written = await asyncio.to_thread(store.record_prefixes, job_id, rows, upto=upto, ended=False)
    known.update(new)
    return len(written)
