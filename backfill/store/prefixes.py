"""The shared prompt prefixes of a job's items (issue 36): the items still to be looked at,
what was found, and the groups as the Batch object shows them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text

from backfill.states import ITEM_TERMINAL
from backfill.store.bodies import ITEM_BODY
from backfill.store.database import Database

_TERMINAL = [s.value for s in ITEM_TERMINAL]

# The unfinished items of a job whose prefix is not looked at yet, in id order, with their
# bodies (their own copy or their bytes in the input file).
_UNSEEN = (
    f"SELECT i.id, {ITEM_BODY} AS body FROM items i WHERE i.job_id = :j AND i.id > :a "
    "AND i.prefix_id IS NULL AND NOT (i.state = ANY(:t)) ORDER BY i.id LIMIT :l"
)

# One write for every item found: only unfinished items still without a prefix (an item
# already claimed keeps the reservation it was claimed under; its lease is as it was).
_RECORD = (
    "UPDATE items i SET prefix_id = f.prefix_id, prefix_blocks = f.blocks "
    "FROM unnest(CAST(:ids AS bigint[]), CAST(:pids AS text[]), CAST(:blocks AS int[])) "
    "AS f(id, prefix_id, blocks) "
    "WHERE i.id = f.id AND i.job_id = :j AND i.prefix_id IS NULL RETURNING i.id"
)

# One in-progress job of these models whose prefixes no worker has looked for, taken: the
# oldest first; a job another worker is taking is skipped.
_TAKE = (
    "UPDATE jobs j SET prefixes_taken_at = now() FROM (SELECT id FROM jobs "
    "WHERE state = 'in_progress' AND prefixes_taken_at IS NULL AND model = ANY(:m) "
    "ORDER BY created_at, id LIMIT 1 FOR UPDATE SKIP LOCKED) t WHERE j.id = t.id "
    "RETURNING j.id, j.endpoint, j.tenant_id, j.model"
)

# The job's prefix pass has ended (looked at every item, or failed): claims stop leaving its
# items for it (``backfill.store.claims.CLAIMABLE_NOW``).
_ENDED = "UPDATE jobs SET prefixes_ended_at = now() WHERE id = :j AND prefixes_ended_at IS NULL"

# The pass has recorded a page, up to item ``:u`` (pages go in id order): claims take the
# items at or below it while it goes on.
_UPTO = "UPDATE jobs SET prefixes_upto = greatest(coalesce(prefixes_upto, 0), :u) WHERE id = :j"

_GROUPS = (
    "SELECT prefix_id, prefix_blocks, count(*) FROM items WHERE job_id = :j "
    "AND prefix_id IS NOT NULL GROUP BY prefix_id, prefix_blocks ORDER BY prefix_id"
)

# The same for several jobs at once (a page of a list).
_GROUPS_OF_JOBS = (
    "SELECT job_id, prefix_id, prefix_blocks, count(*) FROM items WHERE job_id = ANY(:js) "
    "AND prefix_id IS NOT NULL GROUP BY job_id, prefix_id, prefix_blocks "
    "ORDER BY job_id, prefix_id"
)


@dataclass(frozen=True, slots=True)
class PrefixJob:
    """A job taken to find its items' shared prefixes."""

    job_id: str
    endpoint: str
    tenant_id: str
    model: str


@dataclass(frozen=True, slots=True)
class PrefixGroupRecord:
    """Items of one job that start with one shared prefix."""

    prefix_id: str
    blocks: int
    items: int


class Prefixes:
    def __init__(self, db: Database) -> None:
        self._db = db

    def take_prefix_job(self, models: Sequence[str]) -> PrefixJob | None:
        """Take one in-progress job of ``models`` whose prefixes nobody looked for yet (it is
        not offered again: a worker that dies while looking leaves its items reserving their
        whole prompts, as without prefixes)."""
        with self._db.transaction() as conn:
            row = conn.execute(text(_TAKE), {"m": list(models)}).first()
        if row is None:
            return None
        return PrefixJob(str(row[0]), str(row[1]), str(row[2]), str(row[3]))

    def unseen_prefix_items(
        self, job_id: str, *, after_id: int = 0, limit: int = 1000
    ) -> list[tuple[int, str]]:
        """A page of a job's unfinished items whose prefix is not known: (id, body)."""
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(_UNSEEN), {"j": job_id, "a": after_id, "t": _TERMINAL, "l": limit}
            ).all()
        return [(int(r[0]), str(r[1])) for r in rows]

    def record_prefixes(
        self,
        job_id: str,
        found: Sequence[tuple[int, str, int]],
        *,
        upto: int | None = None,
        ended: bool = True,
    ) -> list[int]:
        """Write each item's (id, prefix id, blocks), in one transaction with the pass's mark:
        ``upto``, the last item id it has looked at (claims take the items up to it while it
        goes on), and ``ended`` (claims take all of the job's items); the ids written."""
        for _, _, blocks in found:
            if blocks < 1:
                raise ValueError("a shared prefix is one whole block at least")
        rows: Sequence[Any] = []
        with self._db.transaction() as conn:
            if found:
                rows = conn.execute(
                    text(_RECORD),
                    {
                        "j": job_id,
                        "ids": [f[0] for f in found],
                        "pids": [f[1] for f in found],
                        "blocks": [f[2] for f in found],
                    },
                ).all()
            if upto is not None:
                conn.execute(text(_UPTO), {"j": job_id, "u": upto})
            if ended:
                conn.execute(text(_ENDED), {"j": job_id})
        return [int(r[0]) for r in rows]

    def end_prefix_pass(self, job_id: str) -> None:
        """Mark the prefix pass over ``job_id`` ended without a record (it failed): a node
        that looks for prefixes claims the job's items from now on, whole prompts."""
        with self._db.transaction() as conn:
            conn.execute(text(_ENDED), {"j": job_id})

    def prefix_groups(self, job_id: str) -> list[PrefixGroupRecord]:
        """A job's shared prefixes and how many of its items start with each."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(_GROUPS), {"j": job_id}).all()
        return [PrefixGroupRecord(str(r[0]), int(r[1]), int(r[2])) for r in rows]

    def prefix_groups_of(self, job_ids: list[str]) -> dict[str, list[PrefixGroupRecord]]:
        """:meth:`prefix_groups` of each of ``job_ids`` (those with none left out), in one
        query."""
        found: dict[str, list[PrefixGroupRecord]] = {}
        if not job_ids:
            return found
        with self._db.transaction() as conn:
            rows = conn.execute(text(_GROUPS_OF_JOBS), {"js": job_ids}).all()
        for r in rows:
            found.setdefault(str(r[0]), []).append(
                PrefixGroupRecord(str(r[1]), int(r[2]), int(r[3]))
            )
        return found
