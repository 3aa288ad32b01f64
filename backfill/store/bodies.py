"""Request bodies written once: an item points at its line in the input file's stored pieces.

A batch's bodies are already in Postgres once the file is uploaded. Copying each into its item
at create wrote every byte a second time (the larger part of a create's cost), so an item whose
line can stand for its body keeps ``body`` NULL and names the line instead: piece ``body_seq``
of its job's input file, ``body_len`` bytes from ``body_at``. The pieces are stored
uncompressed and out of line, so reading one line reads only the TOAST chunks under it.

A line stands for its body when the body was stored as sent (no default written into it, no
field rewritten) and Postgres reads the line's ``body`` exactly as Python did: valid UTF-8,
no byte-order mark, no NUL, and no ``\\u0000`` or UTF-16 surrogate escape (Postgres' ``json``
refuses a lone surrogate and cannot turn ``\\u0000`` into text; such a line keeps a copy).
Duplicate keys read the same in both (the last one counts).

A batch goes on when its input file goes: deleting the file, or its expiry, first copies the
bodies of its batches' unfinished items into the items (:func:`keep_bodies`), in the
transaction that deletes it, after locking the file's row so no create can add items that
point into it meanwhile.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from sqlalchemy import Connection, text

from backfill.states import ITEM_TERMINAL

BOM = b"\xef\xbb\xbf"
_UNREADABLE_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89abcdefABCDEF])")
_TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(ITEM_TERMINAL, key=lambda s: s.value))

ITEM_BODY = (
    "coalesce(i.body, (SELECT CAST(CAST(convert_from("
    "substring(c.data FROM i.body_at + 1 FOR i.body_len), 'UTF8') AS json) -> 'body' AS text) "
    "FROM jobs bj JOIN file_chunks c ON c.file_id = bj.input_file_id AND c.seq = i.body_seq "
    "WHERE bj.id = i.job_id))"
)
"""The request body of item ``i`` (an SQL expression over a row of ``items`` aliased ``i``):
its own copy, or the ``body`` of its line in the input file."""

# Lock input files about to go, so a create still storing items that point into one finishes
# first (it holds the file FOR KEY SHARE) and none starts after.
LOCK_FILES = "SELECT id FROM files WHERE id = ANY(:ids) ORDER BY id FOR UPDATE"

# Copy the bodies of the unfinished items that still point into these files (a statement of
# its own, after the lock: it sees every item committed until then).
KEEP_BODIES = (
    f"UPDATE items i SET body = {ITEM_BODY} FROM jobs j "
    "WHERE j.input_file_id = ANY(:ids) AND i.job_id = j.id AND i.body IS NULL "
    f"AND i.state NOT IN ({_TERMINAL_SQL})"
)

# A create storing items that point into the file holds it: a delete (FOR UPDATE) waits for
# the create's commit. None: the file is gone.
HOLD_FILE = "SELECT id FROM files WHERE id = :f FOR KEY SHARE"


def line_stands_for_body(raw: bytes) -> bool:
    """Whether Postgres reads this (valid, parsed) line's ``body`` as Python did."""
    if b"\x00" in raw or raw.startswith(BOM):
        return False
    if b"\\u" in raw and _UNREADABLE_ESCAPE.search(raw):
        return False
    if raw.isascii():
        return True
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def keep_bodies(conn: Connection, file_ids: Sequence[str]) -> list[str]:
    """Lock these input files and copy into their batches' unfinished items the bodies those
    items read from them; returns the ids of the files that still exist (to delete now, in
    ``conn``'s transaction)."""
    ids = list(file_ids)
    if not ids:
        return []
    locked = list(conn.execute(text(LOCK_FILES), {"ids": ids}).scalars())
    if locked:
        conn.execute(text(KEEP_BODIES), {"ids": locked})
    return locked
