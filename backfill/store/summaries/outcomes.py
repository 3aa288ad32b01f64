"""How a summarisation job's steps and documents end: the reduce driver's harvest of the steps
whose items ended, and the decisions it writes back.

A step's key ``(job, document, node)`` is what keeps the driver from making a step twice:
steps are inserted ``ON CONFLICT DO NOTHING``. A step that ends marks its document
(``touched``) for the driver, in the same transaction; deciding on a document unmarks it.

A round reads what of the job's open batches ended in a window, not everything that ended
(:class:`HarvestRead`): from :data:`WINDOW_SLACK_S` before its last round's read. An item's
end is stamped with its transaction's start, so one that committed after that read can carry
an earlier time; an end held open longer than the slack is found by the next full read,
every :data:`FULL_READ_EVERY_S`, or when its batch ends (an ended batch's items are all read).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import text
from sqlalchemy.engine import Connection

from backfill.store.database import Database
from backfill.store.summaries.jobs import INSERT_STEPS, steps_params
from backfill.store.summaries.records import DocumentRow, FinishedStep, NewStep
from backfill.summarize.decide import StepView
from backfill.summarize.prompts import parse_custom_id
from backfill.summarize.states import StepState

# The harvest reads each table once, by its own index, and matches steps to items here: a
# join of steps to items by custom id (``seq:node``, which no index of ``items`` holds) read
# every item of the batch for every pending step, ~160 ms a round for one 327-line batch on a
# 2-core machine, twice a second through a job's map wave, on the engine's own cores.
# The job's pending steps in batches already made (ix_summary_steps_pending).
PENDING_STEPS = (
    "SELECT seq, node, batch_no FROM summary_steps "
    "WHERE job_id = :i AND state = 'pending' AND batch_no IS NOT NULL"
)
# The job's batches that were made, with their state.
MADE_BATCHES = (
    "SELECT b.batch_no, b.batch_id, j.state FROM summary_batches b "
    "JOIN jobs j ON j.id = b.batch_id WHERE b.job_id = :i"
)
# The ended items of open batches, and every item of ended ones (ix_items_job_state).
ENDED_ITEMS = (
    "SELECT job_id, id, custom_id, state FROM items WHERE job_id = ANY(CAST(:open AS text[])) "
    "AND state IN ('succeeded', 'failed', 'expired', 'cancelled')"
)
ITEMS_OF = "SELECT job_id, id, custom_id, state FROM items WHERE job_id = ANY(CAST(:b AS text[]))"
# A windowed round: the items of open batches that ended since ``:since``
# (ix_items_job_finished), then the pending steps they name, by key, and those of ended batches.
RECENT_ENDED_ITEMS = (
    "SELECT job_id, id, custom_id, state FROM items WHERE job_id = ANY(CAST(:open AS text[])) "
    "AND finished_at IS NOT NULL AND finished_at >= :since "
    "AND state IN ('succeeded', 'failed', 'expired', 'cancelled')"
)
PENDING_STEPS_NAMED = (
    "SELECT s.seq, s.node, s.batch_no FROM summary_steps s "
    "JOIN unnest(CAST(:seqs AS int[]), CAST(:nodes AS int[])) AS k(seq, node) "
    "ON s.seq = k.seq AND s.node = k.node "
    "WHERE s.job_id = :i AND s.state = 'pending' AND s.batch_no IS NOT NULL"
)
PENDING_STEPS_OF_BATCHES = (
    "SELECT seq, node, batch_no FROM summary_steps WHERE job_id = :i AND state = 'pending' "
    "AND batch_no = ANY(CAST(:nos AS int[]))"
)
HARVEST_MARKS = "SELECT harvest_mark, harvest_full_at, now() FROM summary_jobs WHERE id = :i"
MARK_HARVESTED = (
    "UPDATE summary_jobs SET harvest_mark = :at, "
    "harvest_full_at = CASE WHEN :full THEN :at ELSE harvest_full_at END WHERE id = :i"
)
WINDOW_SLACK_S = 5.0
"""How far before the last round's read a round's window starts."""
FULL_READ_EVERY_S = 60.0
"""How often a round reads every ended item of the job's open batches."""
ITEM_OUTCOMES = "SELECT id, result, error FROM items WHERE id = ANY(CAST(:ids AS bigint[]))"
ENDED_BATCH = frozenset({"failed", "expired", "cancelled", "completed"})
ENDED_ITEM = frozenset({"succeeded", "failed", "expired", "cancelled"})


@dataclass(frozen=True, slots=True)
class HarvestRead:
    """How a round reads what ended: from ``since`` (None: everything), at ``at`` (the
    database's clock as the round began)."""

    since: datetime | None
    at: datetime

    @property
    def full(self) -> bool:
        return self.since is None


def harvest_read(mark: datetime | None, full_at: datetime | None, now: datetime) -> HarvestRead:
    """A round's read: a window from a little before the last round's, or everything when no
    round has read everything in :data:`FULL_READ_EVERY_S` (pure)."""
    if mark is None or full_at is None or now - full_at >= timedelta(seconds=FULL_READ_EVERY_S):
        return HarvestRead(None, now)
    return HarvestRead(mark - timedelta(seconds=WINDOW_SLACK_S), now)


@dataclass(frozen=True, slots=True)
class StepEnd:
    """A pending step's end, before its item's result is read: its item (id, state), or none
    in a batch that ended without one."""

    seq: int
    node: int
    item_id: int | None
    item_state: str | None
    batch_state: str


def match_ended(
    pending: Iterable[tuple[int, int, int]],
    batches: Mapping[int, tuple[str, str]],
    items: Iterable[tuple[str, int, str, str]],
    limit: int,
) -> list[StepEnd]:
    """The first ``limit`` pending steps, in ``(seq, node)`` order, whose item ended or whose
    batch ended without an item for them. ``pending`` is ``(seq, node, batch_no)``;
    ``batches`` maps a made batch's number to ``(batch id, state)``; ``items`` is ``(batch
    id, item id, custom id, state)`` of the items read (pure)."""
    by_key: dict[tuple[str, str], tuple[int, str]] = {
        (batch, custom_id): (item_id, state) for batch, item_id, custom_id, state in items
    }
    found: list[StepEnd] = []
    for seq, node, batch_no in sorted(pending):
        made = batches.get(batch_no)
        if made is None:  # numbered, not made yet
            continue
        batch_id, batch_state = made
        item = by_key.get((batch_id, f"{seq}:{node}"))
        if item is not None and item[1] in ENDED_ITEM:
            found.append(StepEnd(seq, node, item[0], item[1], batch_state))
        elif item is None and batch_state in ENDED_BATCH:
            found.append(StepEnd(seq, node, None, None, batch_state))
        else:
            continue
        if len(found) == limit:
            break
    return found


END_STEPS = (
    "UPDATE summary_steps s SET state = v.state, summary = v.summary, error = v.error, "
    "prompt_tokens = v.pt, completion_tokens = v.ct "
    "FROM unnest(CAST(:seqs AS int[]), CAST(:nodes AS int[]), CAST(:states AS text[]), "
    "CAST(:summaries AS text[]), CAST(:errors AS text[]), CAST(:pts AS int[]), "
    "CAST(:cts AS int[])) AS v(seq, node, state, summary, error, pt, ct) "
    "WHERE s.job_id = :i AND s.seq = v.seq AND s.node = v.node AND s.state = 'pending'"
)
TOUCH_DOCUMENTS = (
    "UPDATE summary_documents SET touched = true WHERE job_id = :i AND state = 'pending' "
    "AND seq = ANY(CAST(:seqs AS int[]))"
)
TOUCHED = (
    "SELECT seq, chunks FROM summary_documents WHERE job_id = :i AND touched ORDER BY seq LIMIT :n"
)
STEPS_OF = (
    "SELECT seq, node, state, summary, error, prompt_tokens, completion_tokens "
    "FROM summary_steps WHERE job_id = :i AND seq = ANY(CAST(:seqs AS int[]))"
)
# A round's decisions, one statement each (not one a document: a 600,000-document job's round
# took ~0.1 s a document in its updates, a documents request waiting on it for minutes).
DECIDED = (
    "UPDATE summary_documents SET touched = false "
    "WHERE job_id = :i AND seq = ANY(CAST(:seqs AS int[]))"
)
END_DOCUMENTS = (
    "UPDATE summary_documents d SET state = v.state, summary = v.summary, error = v.error, "
    "prompt_tokens = v.pt, completion_tokens = v.ct, split_depth = v.depth, touched = false "
    "FROM unnest(CAST(:seqs AS int[]), CAST(:states AS text[]), CAST(:summaries AS text[]), "
    "CAST(:errors AS text[]), CAST(:pts AS bigint[]), CAST(:cts AS bigint[]), "
    "CAST(:depths AS int[])) AS v(seq, state, summary, error, pt, ct, depth) "
    "WHERE d.job_id = :i AND d.seq = v.seq AND d.state = 'pending'"
)
# Pending steps no batch was made for (none numbered, or numbered and not made).
FAIL_UNMADE = (
    "UPDATE summary_steps s SET state = 'failed', error = :error "
    "WHERE s.job_id = :i AND s.state = 'pending' AND (s.batch_no IS NULL OR EXISTS ("
    "  SELECT 1 FROM summary_batches b WHERE b.job_id = s.job_id AND b.batch_no = s.batch_no "
    "  AND b.batch_id IS NULL)) RETURNING s.seq"
)
FAIL_PENDING = (
    "UPDATE summary_documents SET state = 'failed', error = :error, touched = false "
    "WHERE job_id = :i AND state = 'pending'"
)


class SummaryOutcomes:
    """Steps that ended, recorded; documents decided on, ended or failed."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def harvest_read(self, job_id: str) -> HarvestRead:
        """How the job's next round reads what ended (:func:`harvest_read`)."""
        with self._db.transaction() as conn:
            mark, full_at, now = conn.execute(text(HARVEST_MARKS), {"i": job_id}).one()
        return harvest_read(mark, full_at, now)

    def mark_harvested(self, job_id: str, read: HarvestRead) -> None:
        """The round that read by ``read`` harvested everything it found: the next one's
        window starts from ``read.at``."""
        with self._db.transaction() as conn:
            conn.execute(text(MARK_HARVESTED), {"i": job_id, "at": read.at, "full": read.full})

    def finished_steps(
        self, job_id: str, limit: int, since: datetime | None = None
    ) -> list[FinishedStep]:
        """The first ``limit`` pending steps whose item ended, or whose batch ended without
        an item for them, with the item's result (:func:`match_ended`): of open batches,
        those whose item ended at or after ``since`` (None: any)."""
        with self._db.transaction() as conn:
            batches = {
                r.batch_no: (r.batch_id, r.state)
                for r in conn.execute(text(MADE_BATCHES), {"i": job_id})
            }
            if since is None:
                pending, items = _everything_ended(conn, job_id, batches)
            else:
                pending, items = _ended_since(conn, job_id, batches, since)
            found = match_ended(pending, batches, items, limit)
            ids = [e.item_id for e in found if e.item_id is not None]
            outcomes = {
                r.id: (r.result, r.error)
                for r in (conn.execute(text(ITEM_OUTCOMES), {"ids": ids}) if ids else ())
            }
        return [
            FinishedStep(
                e.seq, e.node, e.item_state, e.batch_state, *outcomes.get(e.item_id, (None, None))
            )
            if e.item_id is not None
            else FinishedStep(e.seq, e.node, None, e.batch_state, None, None)
            for e in found
        ]

    def end_steps(self, job_id: str, outcomes: Mapping[tuple[int, int], StepView]) -> None:
        """Record how steps ended and mark their documents for the driver, in one
        transaction (a step already ended is left as it is)."""
        if not outcomes:
            return
        ended = sorted(outcomes.items())
        with self._db.transaction() as conn:
            conn.execute(
                text(END_STEPS),
                {
                    "i": job_id,
                    "seqs": [seq for (seq, _), _ in ended],
                    "nodes": [node for (_, node), _ in ended],
                    "states": [view.state.value for _, view in ended],
                    "summaries": [view.summary for _, view in ended],
                    "errors": [view.error for _, view in ended],
                    "pts": [view.prompt_tokens for _, view in ended],
                    "cts": [view.completion_tokens for _, view in ended],
                },
            )
            conn.execute(
                text(TOUCH_DOCUMENTS), {"i": job_id, "seqs": sorted({s for s, _ in outcomes})}
            )

    def touched_documents(self, job_id: str, limit: int) -> list[tuple[int, int]]:
        """``(seq, chunks)`` of the documents a step of which ended since the last decision."""
        with self._db.transaction() as conn:
            rows = conn.execute(text(TOUCHED), {"i": job_id, "n": limit}).all()
        return [(r.seq, r.chunks) for r in rows]

    def steps_of(self, job_id: str, seqs: Sequence[int]) -> dict[int, dict[int, StepView]]:
        found: dict[int, dict[int, StepView]] = {seq: {} for seq in seqs}
        with self._db.transaction() as conn:
            rows = conn.execute(text(STEPS_OF), {"i": job_id, "seqs": list(seqs)}).all()
        for r in rows:
            found[r.seq][r.node] = StepView(
                StepState(r.state), r.summary, r.prompt_tokens, r.completion_tokens, r.error
            )
        return found

    def decide_documents(
        self,
        job_id: str,
        new_steps: Mapping[int, Sequence[NewStep]],
        ended: Mapping[int, DocumentRow],
    ) -> None:
        """Apply the driver's decisions in one transaction: the new reduce steps (a step
        made before is not made again), the documents that ended, and every document
        decided on unmarked."""
        with self._db.transaction() as conn:
            steps = [(seq, s.node, s.body) for seq, made in new_steps.items() for s in made]
            if steps:
                conn.execute(text(INSERT_STEPS), steps_params(job_id, steps))
            decided = sorted(set(new_steps) - set(ended))
            if decided:
                conn.execute(text(DECIDED), {"i": job_id, "seqs": decided})
            if ended:
                rows = [ended[seq] for seq in sorted(ended)]
                conn.execute(
                    text(END_DOCUMENTS),
                    {
                        "i": job_id,
                        "seqs": [d.seq for d in rows],
                        "states": [d.state.value for d in rows],
                        "summaries": [d.summary for d in rows],
                        "errors": [d.error for d in rows],
                        "pts": [d.prompt_tokens for d in rows],
                        "cts": [d.completion_tokens for d in rows],
                        "depths": [d.split_depth for d in rows],
                    },
                )

    def fail_unmade_steps(self, job_id: str, error: str) -> int:
        """Fail the pending steps no batch was made for, and mark their documents for the
        driver, in one transaction; returns how many."""
        with self._db.transaction() as conn:
            seqs = list(conn.execute(text(FAIL_UNMADE), {"i": job_id, "error": error}).scalars())
            if seqs:
                conn.execute(text(TOUCH_DOCUMENTS), {"i": job_id, "seqs": sorted(set(seqs))})
        return len(seqs)

    def fail_pending_documents(self, job_id: str, error: str) -> int:
        with self._db.transaction() as conn:
            return conn.execute(text(FAIL_PENDING), {"i": job_id, "error": error}).rowcount


Pending = list[tuple[int, int, int]]
"""``(seq, node, batch_no)`` of pending steps."""
ItemRows = list[tuple[str, int, str, str]]
"""``(batch id, item id, custom id, state)`` of items read."""


def _everything_ended(
    conn: Connection, job_id: str, batches: Mapping[int, tuple[str, str]]
) -> tuple[Pending, ItemRows]:
    """Every pending step of the job, the ended items of its open batches and every item of
    its ended ones that hold a pending step."""
    pending = [
        (r.seq, r.node, r.batch_no) for r in conn.execute(text(PENDING_STEPS), {"i": job_id})
    ]
    wanted = {batches[b] for _, _, b in pending if b in batches}
    open_ = sorted(bid for bid, state in wanted if state not in ENDED_BATCH)
    return pending, _items(
        conn, open_, sorted(bid for bid, state in wanted if state in ENDED_BATCH)
    )


def _ended_since(
    conn: Connection, job_id: str, batches: Mapping[int, tuple[str, str]], since: datetime
) -> tuple[Pending, ItemRows]:
    """The pending steps whose item in an open batch ended at or after ``since``, with those
    items, and the pending steps of ended batches with every item of those batches."""
    open_ = sorted(bid for bid, state in batches.values() if bid and state not in ENDED_BATCH)
    recent: ItemRows = (
        [
            (r.job_id, r.id, r.custom_id, r.state)
            for r in conn.execute(text(RECENT_ENDED_ITEMS), {"open": open_, "since": since})
        ]
        if open_
        else []
    )
    named = sorted({key for _, _, custom_id, _ in recent if (key := parse_custom_id(custom_id))})
    pending: Pending = []
    if named:
        params = {"i": job_id, "seqs": [k[0] for k in named], "nodes": [k[1] for k in named]}
        pending += [
            (r.seq, r.node, r.batch_no) for r in conn.execute(text(PENDING_STEPS_NAMED), params)
        ]
    ended_nos = sorted(no for no, (bid, state) in batches.items() if bid and state in ENDED_BATCH)
    if ended_nos:
        params = {"i": job_id, "nos": ended_nos}
        in_ended = [
            (r.seq, r.node, r.batch_no)
            for r in conn.execute(text(PENDING_STEPS_OF_BATCHES), params)
        ]
        pending += in_ended
        holding = sorted({batches[b][0] for _, _, b in in_ended})
        recent += _items(conn, [], holding)
    return pending, recent


def _items(conn: Connection, open_: list[str], ended: list[str]) -> ItemRows:
    """The ended items of the batches ``open_``, every item of the batches ``ended``."""
    reads = [(ENDED_ITEMS, {"open": open_}), (ITEMS_OF, {"b": ended})]
    return [
        (r.job_id, r.id, r.custom_id, r.state)
        for query, batch_ids in reads
        if any(batch_ids.values())
        for r in conn.execute(text(query), batch_ids)
    ]
