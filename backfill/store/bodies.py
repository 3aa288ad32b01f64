"""Request bodies written once: an item points at its body in the input file's stored pieces.

A batch's bodies are already in Postgres once the file is uploaded. Copying each into its
item at create wrote every byte a second time, so an item whose body can be read from its
line keeps ``body`` NULL and names the bytes instead: ``body_len`` bytes from ``body_at`` of
piece ``body_seq`` of its job's input file. The pieces are stored uncompressed and out of
line, so a claim reads only the TOAST chunks under those bytes (a compressed piece would be
decompressed up to them: claims of 64 items took 2-3x as long), and Postgres parses nothing.

The bytes stand for the body when the body is stored as sent (no default written into it, no
field rewritten) and they read back as exactly that body (:func:`body_span`); otherwise the
item keeps its own copy, as every item did before.

A batch goes on when its input file goes: deleting the file, or its expiry, first copies the
bodies of its batches' unfinished items into the items (:func:`keep_bodies`), in the
transaction that deletes it, after locking the file's row so no create can add items that
point into it meanwhile.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import pydantic_core
from sqlalchemy import Connection, text

from backfill.states import ITEM_TERMINAL

_BODY_KEY = re.compile(rb'"body"\s*:\s*')
_BODY_TEXT_KEY = re.compile(r'"body"\s*:\s*')
_DECODER = json.JSONDecoder()
_TERMINAL_SQL = ", ".join(f"'{s.value}'" for s in sorted(ITEM_TERMINAL, key=lambda s: s.value))

ITEM_BODY = (
    "coalesce(i.body, (SELECT convert_from(substring(c.data FROM i.body_at + 1 FOR i.body_len), "
    "'UTF8') FROM jobs bj JOIN file_chunks c ON c.file_id = bj.input_file_id "
    "AND c.seq = i.body_seq WHERE bj.id = i.job_id))"
)
"""The request body of item ``i`` (an SQL expression over a row of ``items`` aliased ``i``):
its own copy, or its bytes in the input file."""

# Lock input files about to go, so a create still storing items that point into one finishes
# first (it holds the file FOR KEY SHARE) and none starts after.
LOCK_FILES = "SELECT id FROM files WHERE id = ANY(:ids) ORDER BY id FOR UPDATE"

# Copy the bodies of the unfinished items that still point into these files (a statement of
# its own, after the lock: it sees every item committed until then).
# The items are locked in id order first, as every statement that locks many items does: no
# two can wait in a cycle (a cancel's end_items, a worker's commit).
KEEP_BODIES = (
    "WITH kept AS (SELECT i.id FROM items i JOIN jobs j ON i.job_id = j.id "
    "  WHERE j.input_file_id = ANY(:ids) AND i.body IS NULL "
    f"  AND i.state NOT IN ({_TERMINAL_SQL}) ORDER BY i.id FOR UPDATE OF i) "
    f"UPDATE items i SET body = {ITEM_BODY} FROM kept WHERE i.id = kept.id"
)

# A create storing items that point into the file holds it: a delete (FOR UPDATE) waits for
# the create's commit. None: the file is gone.
HOLD_FILE = "SELECT id FROM files WHERE id = :f FOR KEY SHARE"


def body_span(raw: bytes, body: dict[str, Any]) -> tuple[int, int] | None:
    """Where in the (valid, parsed) line ``raw`` the bytes of ``body`` lie, as (first byte,
    length), if some run of them reads back as exactly ``body``; else None.

    A request line ends with its body as a rule (OpenAI's examples: custom_id, method, url,
    body), so the first candidate is from after the last ``"body":`` to the line's closing
    brace, checked by one fast parse; a line laid out otherwise is searched with json's
    decoder, which says where each value ends. A run counts only if it parses to a value
    equal to ``body`` and is valid UTF-8: the worker then reads from those bytes what
    validation checked, whatever else the line holds."""
    close = raw.rstrip().rfind(b"}")
    keys = list(_BODY_KEY.finditer(raw, 0, close))
    if not keys:
        return None
    start = keys[-1].end()
    candidate = raw[start:close].rstrip()
    try:
        same = pydantic_core.from_json(candidate, allow_inf_nan=False) == body
    except ValueError:
        same = False
    if same and (candidate.isascii() or _is_utf8(candidate)):
        return start, len(candidate)
    return _decoded_body_span(raw, body)


def _decoded_body_span(raw: bytes, body: dict[str, Any]) -> tuple[int, int] | None:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    for key in reversed(list(_BODY_TEXT_KEY.finditer(line))):
        try:
            value, end = _DECODER.raw_decode(line, key.end())
        except ValueError:
            continue
        if value == body:
            at = len(line[: key.end()].encode())
            return at, len(line[key.end() : end].encode())
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
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
