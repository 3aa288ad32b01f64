"""Ingest: a validating job's items stored by binary COPY, and exact prompt tokens recorded
after tokenization, with the counters moved in the same transaction.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import IO, Any

import psycopg
from psycopg.copy import Copy, FileWriter
from sqlalchemy import text

from backfill.errors import NotFound, StaleWrite
from backfill.states import JobState
from backfill.store.bodies import HOLD_FILE
from backfill.store.counters import add_to_counters
from backfill.store.database import Database
from backfill.store.jobs import move_job
from backfill.store.records import NewItem

# Stream a job's items into items, binary (bodies are not escaped).
COPY_ITEMS = (
    "COPY items (job_id, tenant_id, line_no, custom_id, body, body_seq, body_at, body_len, "
    "max_output_tokens, output_defaulted, prompt_tokens, reservation_tokens, deadline) "
    "FROM STDIN (FORMAT BINARY)"
)

# The job being stored into, held FOR KEY SHARE: moves of the job still go ahead, the recovery of
# stale creates skips it.
JOB_FOR_INGEST = (
    "SELECT deadline, state, tenant_id, input_file_id FROM jobs WHERE id = :i FOR KEY SHARE"
)

# Whether the job is still validating before its items go in (a cancel meanwhile: none does).
JOB_STATE = "SELECT state FROM jobs WHERE id = :i"
# A job of one item shares no prompt prefix with another item of its own: no prefix pass
# takes it and no claim holds it for one (``backfill.store.prefixes``; a summarisation job's
# last reduce steps come as batches of one, each an engine call and a hold for nothing).
ONE_ITEM_PREFIXES_ENDED = (
    "UPDATE jobs SET prefixes_taken_at = now(), prefixes_ended_at = now() WHERE id = :i"
)

# Whether the job is still validating once the items are in (locked so no move slips in before
# commit).
JOB_STATE_LOCKED = "SELECT state FROM jobs WHERE id = :i FOR NO KEY UPDATE"

# Exact prompt tokens and reservations for many items; returns each job's prompt-token delta for
# the counters.
SET_PROMPT_TOKENS = (
    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
    "CAST(:p AS int[]), CAST(:r AS int[])) AS v(id, p, r)), "
    "old AS (SELECT i.id, i.job_id, coalesce(i.prompt_tokens, 0) AS old_p "
    "FROM items i JOIN v ON v.id = i.id FOR UPDATE OF i) "
    "UPDATE items i SET prompt_tokens = v.p, reservation_tokens = v.r "
    "FROM v, old WHERE i.id = v.id AND old.id = v.id "
    "RETURNING i.job_id, v.p - old.old_p"
)


class Ingest:
    """Storing a job's items."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def insert_items(
        self,
        job_id: str,
        items: Iterable[NewItem],
        *,
        start_reason: Callable[[int], str] | None = None,
    ) -> int:
        """Store a ``validating`` job's items with binary COPY; counters move in the same
        transaction. With ``start_reason`` (the event's reason, given the count) the job moves
        to ``in_progress`` in that transaction too, so its items become claimable exactly when
        the job runs.

        The job row is held ``FOR KEY SHARE`` while the items stream in: a cancel, an expiry
        or a failure still moves the job at once (they lock ``FOR NO KEY UPDATE``), and the
        recovery of stale creates sees that this one is alive (it locks ``FOR UPDATE SKIP
        LOCKED``). At the end the job must still be validating, or nothing is stored and
        ``StaleWrite`` says so: no item of a job that ended meanwhile ever exists.

        The job's input file is held ``FOR KEY SHARE`` too: items whose body is their line
        in it (``NewItem.body_seq``, see ``backfill.store.bodies``) commit before the file
        can be deleted, and a delete then copies their bodies. If the file is already gone,
        such an item raises ``NotFound`` and nothing is stored.
        """
        with self._db.transaction() as conn:
            row = conn.execute(
                text(JOB_FOR_INGEST),
                {"i": job_id},
            ).first()
            if row is None:
                raise NotFound(f"No such Batch object: {job_id}")
            deadline, tenant_id, input_file_id = row[0], row[2], row[3]
            if row[1] != JobState.VALIDATING.value:
                raise StaleWrite(f"job {job_id} is {row[1]}; its items are no longer wanted")
            file_held = conn.execute(text(HOLD_FILE), {"f": input_file_id}).first() is not None
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            with tempfile.SpooledTemporaryFile(SPOOL_IN_MEMORY_BYTES, prefix="bf-items-") as spool:
                with raw.cursor() as cur:
                    n, prompt_sum, max_out_sum = _spool_items(
                        cur, spool, job_id, tenant_id, deadline, items, file_held, input_file_id
                    )
                state = conn.execute(text(JOB_STATE), {"i": job_id}).scalar_one()
                if state != JobState.VALIDATING.value:
                    raise StaleWrite(f"job {job_id} is {state}; its items are no longer wanted")
                spool.seek(0)
                with raw.cursor() as cur, cur.copy(COPY_ITEMS) as copy:
                    while piece := spool.read(SPOOL_PIECE_BYTES):
                        copy.write(piece)
            if n < 2:
                conn.execute(text(ONE_ITEM_PREFIXES_ENDED), {"i": job_id})
            add_to_counters(
                conn,
                {
                    job_id: {
                        "total": n,
                        "queued": n,
                        "prompt_tokens": prompt_sum,
                        "max_output_tokens": max_out_sum,
                    }
                },
            )
            if start_reason is not None:
                move_job(conn, job_id, JobState.IN_PROGRESS, reason=start_reason(n))
            else:
                state = conn.execute(
                    text(JOB_STATE_LOCKED),
                    {"i": job_id},
                ).scalar_one()
                if state != JobState.VALIDATING.value:
                    raise StaleWrite(f"job {job_id} is {state}; its items are no longer wanted")
        return n

    def set_prompt_tokens(self, counts: Sequence[tuple[int, int, int]]) -> None:
        """Record exact (item_id, prompt_tokens, reservation_tokens) after tokenization."""
        if not counts:
            return
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(SET_PROMPT_TOKENS),
                {
                    "ids": [c[0] for c in counts],
                    "p": [c[1] for c in counts],
                    "r": [c[2] for c in counts],
                },
            ).all()
            deltas: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            for job_id, delta in rows:
                deltas[job_id]["prompt_tokens"] += delta
            add_to_counters(conn, deltas)


COPY_TYPES = (
    "text",
    "text",
    "int4",
    "text",
    "text",
    "int4",
    "int4",
    "int4",
    "int4",
    "bool",
    "int4",
    "int4",
    "timestamptz",
)
"""The types of ``COPY_ITEMS``' columns, in its order."""


SPOOL_IN_MEMORY_BYTES = 16 << 20
"""A job's COPY rows kept in memory up to this size; a larger file's go to a temporary file."""

SPOOL_PIECE_BYTES = 1 << 20
"""How much of the spool each write to the COPY sends."""


def _spool_items(
    cur: psycopg.Cursor[Any],
    spool: IO[bytes],
    job_id: str,
    tenant_id: str,
    deadline: datetime,
    items: Iterable[NewItem],
    file_held: bool,
    input_file_id: str,
) -> tuple[int, int, int]:
    """Write ``items`` into ``spool`` as the binary COPY data of ``COPY_ITEMS`` (psycopg's own
    formatting, nothing sent): (count, prompt tokens, most output tokens) of what was
    written. ``cur`` lends its adapters; it runs nothing."""
    n = prompt_sum = max_out_sum = 0
    with Copy(cur, binary=True, writer=FileWriter(spool)) as copy:
        copy.set_types(list(COPY_TYPES))
        for it in items:
            if it.body is None and not file_held:
                raise NotFound(
                    f"No such File object: {input_file_id} (deleted while the batch "
                    "was being validated)"
                )
            copy.write_row(
                (
                    job_id,
                    tenant_id,
                    it.line_no,
                    it.custom_id,
                    it.body,
                    it.body_seq,
                    it.body_at,
                    it.body_len,
                    it.max_output_tokens,
                    it.output_defaulted,
                    it.prompt_tokens,
                    it.reservation_tokens,
                    deadline,
                )
            )
            n += 1
            prompt_sum += it.prompt_tokens or 0
            max_out_sum += it.max_output_tokens
    return n, prompt_sum, max_out_sum
