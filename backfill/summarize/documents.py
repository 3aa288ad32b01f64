"""What a source yields, and the checks every reader applies to a row.

A source yields, in its own order, one :class:`Document` per row it can summarise and one
:class:`RowError` per row it cannot (an empty text, a missing or repeated id, bytes that are
not UTF-8): a bad row is recorded and reading goes on, so one odd row out of millions does not
lose the job. What makes the whole source unreadable (no such file, no such column) raises
:class:`SourceInvalid` before the first row.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from backfill.summarize.seen_ids import SeenIds

MAX_ID_CHARS = 512
"""Longest document id: ids become batch ``custom_id`` prefixes and result rows."""


class SourceInvalid(ValueError):
    """A source that cannot be read at all (the message says why, for the user)."""


@dataclass(frozen=True, slots=True)
class Document:
    """One document to summarise: its id in the source and its text."""

    id: str
    text: str


@dataclass(frozen=True, slots=True)
class RowError:
    """A row of the source that is not summarised, and why; it appears in the results."""

    row: int
    """Position in the source (0-based; a file's position in the folder's sorted listing)."""
    id: str | None
    """The row's id where it has one."""
    error: str


SourceRow = Document | RowError


@dataclass(slots=True)
class RowGate:
    """The checks a row passes before it is a :class:`Document`: an id that is present, not
    too long and not seen before in this source, and a text that is not blank.

    Ids seen are kept to find repeats: their memory grows with the number of rows (21 to 43
    bytes a row, :class:`SeenIds`), not with the size of the texts or the ids.
    """

    seen: SeenIds = field(default_factory=SeenIds)

    def admit(self, row: int, doc_id: object, text: object) -> SourceRow:
        if doc_id is None or (isinstance(doc_id, str) and not doc_id.strip()):
            return RowError(row, None, "missing id")
        if isinstance(doc_id, bool) or not isinstance(doc_id, str | int):
            return RowError(row, None, f"id must be a string or an integer, not {_kind(doc_id)}")
        key = str(doc_id)
        if len(key) > MAX_ID_CHARS:
            return RowError(row, key[:MAX_ID_CHARS], f"id longer than {MAX_ID_CHARS} characters")
        if not self.seen.add(key):
            return RowError(row, key, f"duplicate id {key!r}: only its first row is summarised")
        if text is None:
            return RowError(row, key, "missing text")
        if not isinstance(text, str):
            return RowError(row, key, f"text must be a string, not {_kind(text)}")
        if _has_undecodable(text):
            return RowError(row, key, "text is not valid UTF-8")
        if not text.strip():
            return RowError(row, key, "empty text")
        return Document(key, text)


def _kind(value: object) -> str:
    return type(value).__name__


def _has_undecodable(text: str) -> bool:
    # Readers decode with ``surrogateescape``: bytes that are not UTF-8 become lone surrogates.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def decode_utf8(data: bytes) -> str | None:
    """``data`` as text, or None where it is not UTF-8 (a leading BOM is dropped)."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def documents_only(rows: Iterator[SourceRow]) -> Iterator[Document]:
    """The documents of a source, its row errors skipped (for callers that count them apart)."""
    for row in rows:
        if isinstance(row, Document):
            yield row
