"""Files: uploads stored in pieces by binary COPY, and output files rendered from a job's items.

A stored file of any size costs one piece of memory on the way in and on the way out.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO, cast

import psycopg
from sqlalchemy import Connection, text

from backfill import ids
from backfill.errors import NotFound
from backfill.store.bodies import keep_bodies
from backfill.store.database import Database
from backfill.store.records import FilePage, FileRecord

FILE_CHUNK_BYTES = 1024 * 1024
"""Pieces of stored files, unless the caller says (``Settings.file_chunk_bytes``)."""

# Stream the pieces of a file into file_chunks, binary (no text escaping of the bytes).
COPY_PIECES = "COPY file_chunks (file_id, seq, data) FROM STDIN (FORMAT BINARY)"
# A file uploaded before files were stored in pieces: its whole content, one value.
WHOLE_CONTENT = "SELECT content FROM files WHERE id = %s"
# One piece of a stored file, by its sequence number (read binary: see Database.read_binary).
PIECE = "SELECT data FROM file_chunks WHERE file_id = %s AND seq = %s"


def _read_pieces(source: BinaryIO, chunk_bytes: int) -> Iterator[bytes]:
    while piece := source.read(chunk_bytes):
        yield piece


def _copy_pieces(conn: Connection, file_id: str, pieces: Iterable[bytes]) -> int:
    """COPY ``pieces`` into ``file_chunks`` one row each; returns the bytes stored."""
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    size = seq = 0
    with (
        raw.cursor() as cur,
        cur.copy(COPY_PIECES) as copy,
    ):
        copy.set_types(["text", "int4", "bytea"])
        for piece in pieces:
            if not piece:
                continue
            copy.write_row((file_id, seq, piece))
            size += len(piece)
            seq += 1
    return size


# A file row (size 0 until its pieces are stored); returns when it was made and when it
# expires: ``:x`` seconds after, or for a job's result file its ``output_expires_after_s``.
CREATE_FILE = (
    "INSERT INTO files (id, tenant_id, purpose, filename, bytes, job_id, expires_at) "
    "SELECT :i, :t, :p, :f, :b, CAST(:j AS varchar), now() + make_interval(secs => coalesce("
    "CAST(:x AS double precision), "
    "(SELECT output_expires_after_s FROM jobs WHERE id = CAST(:j AS varchar)))) "
    "RETURNING created_at, expires_at"
)

# The bytes stored, once the COPY of the pieces is done, and what the upload's scan found.
SET_FILE_SIZE = "UPDATE files SET bytes = :b, output_tokens_bound = :o WHERE id = :i"

# Files that have not expired (an expired one is gone for its tenant before maintenance
# deletes it).
LIVE = "(expires_at IS NULL OR expires_at > now())"

# One of the tenant's files (another tenant's is not found).
GET_FILE = (
    "SELECT id, tenant_id, purpose, filename, bytes, job_id, created_at, expires_at, "
    "output_tokens_bound "
    f"FROM files WHERE id = :i AND tenant_id = :t AND {LIVE}"
)

# A page of the tenant's files, of one purpose or all, newest (or oldest) first, after the
# cursor file ``:a`` (keyset on created_at, id: any page of any size costs one index range;
# a cursor that names no file of the tenant gives an empty page). One more than the page,
# to tell whether there is more.
LIST_FILES = {
    order: (
        "SELECT id, tenant_id, purpose, filename, bytes, job_id, created_at, expires_at, "
        f"output_tokens_bound FROM files f WHERE tenant_id = :t AND {LIVE} "
        "AND (CAST(:p AS text) IS NULL OR purpose = :p) "
        "AND (CAST(:a AS text) IS NULL OR (f.created_at, f.id) "
        f"{cmp} (SELECT c.created_at, c.id FROM files c WHERE c.id = :a AND c.tenant_id = :t)) "
        f"ORDER BY created_at {order}, id {order} LIMIT :l"
    )
    for order, cmp in (("DESC", "<"), ("ASC", ">"))
}

# The same page as one File list's objects, written by Postgres: a page of 10,000 files built
# in the API (rows, records, JSON) took ~80-160 ms of its one interpreter, and one tenant's
# list loops held every other tenant's requests behind them. Each object is OpenAI's File
# object field for field, in order, byte for byte what ``queue_api.schemas.file_list_json``
# writes of the records (``tests/integration/test_file_list_page.py``).
_FILE_OBJECT = (
    """'{"id":' || to_json(id)::text || ',"object":"file","bytes":' || bytes """
    """|| ',"created_at":' || floor(extract(epoch FROM created_at))::bigint """
    """|| ',"filename":' || to_json(filename)::text || ',"purpose":' || to_json(purpose)::text """
    """|| ',"status":"processed","status_details"\\:null,"expires_at":' """
    """|| coalesce(floor(extract(epoch FROM expires_at))::bigint::text, 'null') || '}'"""
)
LIST_FILES_PAGE = {
    order: (
        f"WITH page AS (SELECT id, {_FILE_OBJECT} AS one, "
        f"row_number() OVER (ORDER BY created_at {order}, id {order}) AS n "
        f"FROM files f WHERE tenant_id = :t AND {LIVE} "
        "AND (CAST(:p AS text) IS NULL OR purpose = :p) "
        "AND (CAST(:a AS text) IS NULL OR (f.created_at, f.id) "
        f"{cmp} (SELECT c.created_at, c.id FROM files c WHERE c.id = :a AND c.tenant_id = :t)) "
        f"ORDER BY created_at {order}, id {order} LIMIT :l + 1) "
        "SELECT coalesce(string_agg(one, ',' ORDER BY n) FILTER (WHERE n <= :l), ''), "
        "(array_agg(id ORDER BY n))[1], "
        "(array_agg(id ORDER BY n DESC) FILTER (WHERE n <= :l))[1], count(*) > :l FROM page"
    )
    for order, cmp in (("DESC", "<"), ("ASC", ">"))
}

# Files whose time is up, oldest first (maintenance deletes them; their pieces cascade).
# One a create is storing items from is skipped this round.
EXPIRED_FILES = (
    "SELECT id FROM files WHERE expires_at IS NOT NULL AND expires_at <= now() "
    "ORDER BY expires_at LIMIT :l FOR UPDATE SKIP LOCKED"
)
DELETE_FILES = "DELETE FROM files WHERE id = ANY(:ids) RETURNING id"

# Whether a file is stored in pieces, stored whole (from before pieces), or rendered.
FILE_KIND = (
    "SELECT job_id IS NULL AND bytes > 0, content IS NOT NULL FROM files "
    f"WHERE id = :i AND tenant_id = :t AND {LIVE}"
)

# The first bytes of one of the tenant's stored files (its first piece's, or its whole
# content's for a file stored before pieces): a slice of a TOASTed value is read and
# decompressed only as far as it goes.
FILE_HEAD = (
    "SELECT coalesce((SELECT substring(c.data FROM 1 FOR %s) FROM file_chunks c "
    "WHERE c.file_id = f.id AND c.seq = 0), substring(f.content FROM 1 FOR %s), ''::bytea) "
    "FROM files f WHERE f.id = %s AND f.tenant_id = %s "
    "AND (f.expires_at IS NULL OR f.expires_at > now())"
)

# One of the tenant's files, if it exists (locked by keep_bodies before it is deleted).
OWNED_FILE = "SELECT id FROM files WHERE id = :i AND tenant_id = :t"


class Files:
    """Stored and rendered files."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_file(
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        content: bytes | BinaryIO | Iterable[bytes] | None,
        *,
        size_bytes: int | None = None,
        job_id: str | None = None,
        chunk_bytes: int = FILE_CHUNK_BYTES,
        expires_after_s: int | None = None,
        tokens_bound: Callable[[], int | None] | None = None,
    ) -> FileRecord:
        """A file row; ``content`` (bytes, or a binary file read to its end, in pieces of
        ``chunk_bytes``; or the pieces themselves, as an upload's scan cuts them) is stored by
        one binary COPY, so a file of any size costs one piece of memory. ``None``: a file
        rendered from ``job_id``'s items when read. ``tokens_bound``, asked once every piece
        is stored, gives the file's ``output_tokens_bound``. An exception from the pieces
        stores nothing."""
        file_id = ids.new_file_id()
        pieces: Iterable[bytes] | None
        if isinstance(content, bytes):
            pieces = _read_pieces(io.BytesIO(content), chunk_bytes)
        elif content is None or not hasattr(content, "read"):
            pieces = content
        else:
            pieces = _read_pieces(cast(BinaryIO, content), chunk_bytes)
        size = size_bytes or 0
        bound = None
        with self._db.transaction() as conn:
            row = conn.execute(
                text(CREATE_FILE),
                {
                    "i": file_id,
                    "t": tenant_id,
                    "p": purpose,
                    "f": filename,
                    "b": size,
                    "j": job_id,
                    "x": expires_after_s,
                },
            ).one()
            if pieces is not None:
                size = _copy_pieces(conn, file_id, pieces)
                bound = tokens_bound() if tokens_bound is not None else None
                conn.execute(text(SET_FILE_SIZE), {"b": size, "o": bound, "i": file_id})
        return FileRecord(
            file_id, tenant_id, purpose, filename, size, job_id, row[0], row[1], bound
        )

    def get_file(self, tenant_id: str, file_id: str) -> FileRecord:
        with self._db.transaction() as conn:
            row = conn.execute(
                text(GET_FILE),
                {"i": file_id, "t": tenant_id},
            ).first()
        if row is None:
            raise NotFound(f"No such File object: {file_id}")
        return FileRecord(*row)

    def list_files(
        self,
        tenant_id: str,
        *,
        purpose: str | None = None,
        limit: int = 100,
        after: str | None = None,
        ascending: bool = False,
    ) -> tuple[list[FileRecord], bool]:
        """A page of the tenant's files after the cursor ``after`` (a file id), and whether
        there are more."""
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(LIST_FILES["ASC" if ascending else "DESC"]),
                {"t": tenant_id, "p": purpose, "a": after, "l": limit + 1},
            ).all()
        return [FileRecord(*r) for r in rows[:limit]], len(rows) > limit

    def list_files_page(
        self,
        tenant_id: str,
        *,
        purpose: str | None = None,
        limit: int = 100,
        after: str | None = None,
        ascending: bool = False,
    ) -> FilePage:
        """The page :meth:`list_files` reads, as its File objects' JSON (written by Postgres,
        so a page costs this process one string, not a record and an object per file)."""
        with self._db.transaction() as conn:
            data, first, last, more = conn.execute(
                text(LIST_FILES_PAGE["ASC" if ascending else "DESC"]),
                {"t": tenant_id, "p": purpose, "a": after, "l": limit},
            ).one()
        return FilePage(data, first, last, bool(more))

    def delete_expired_files(self, limit: int = 1000) -> list[str]:
        """Delete files past their ``expires_at`` (up to ``limit``); returns their ids. The
        batches of an expired input file go on: their unfinished items keep their bodies."""
        with self._db.transaction() as conn:
            due = list(conn.execute(text(EXPIRED_FILES), {"l": limit}).scalars())
            gone = keep_bodies(conn, due)
            if not gone:
                return []
            return list(conn.execute(text(DELETE_FILES), {"ids": gone}).scalars())

    def file_pieces(self, tenant_id: str, file_id: str) -> Iterator[bytes] | None:
        """A stored file's bytes, one piece per query (no connection is held between them),
        or None for a file rendered from a job's items. NotFound is raised at once, before
        the first piece is asked for."""
        with self._db.transaction() as conn:
            row = conn.execute(
                text(FILE_KIND),
                {"i": file_id, "t": tenant_id},
            ).first()
        if row is None:
            raise NotFound(f"No such File object: {file_id}")
        stored, legacy = row
        if not stored and not legacy:
            return None
        return self._pieces(file_id, legacy)

    def file_head(self, tenant_id: str, file_id: str, max_bytes: int) -> bytes:
        """The first ``max_bytes`` of a stored input file (fewer if it is shorter; empty for
        a file rendered from a job's items), in one query that reads no more of it. NotFound
        when the tenant has no such live file."""
        head = self._db.read_binary(FILE_HEAD, (max_bytes, max_bytes, file_id, tenant_id))
        if head is None:
            raise NotFound(f"No such File object: {file_id}")
        return head

    def file_chunks(self, tenant_id: str, file_id: str) -> Iterator[bytes] | None:
        """A stored file's pieces in ``seq`` order, as :meth:`file_pieces` reads them; None
        when the file is not stored in pieces (rendered, or stored whole before pieces), so
        no line of it can be pointed at."""
        with self._db.transaction() as conn:
            row = conn.execute(text(FILE_KIND), {"i": file_id, "t": tenant_id}).first()
        if row is None:
            raise NotFound(f"No such File object: {file_id}")
        return self._pieces(file_id, False) if row[0] else None

    def _pieces(self, file_id: str, legacy: bool) -> Iterator[bytes]:
        if legacy:
            # Uploaded before files were stored in pieces: one piece, the whole file.
            whole = self._db.read_binary(WHOLE_CONTENT, (file_id,))
            if whole is not None:
                yield whole
            return
        seq = 0
        while (piece := self._db.read_binary(PIECE, (file_id, seq))) is not None:
            yield piece
            seq += 1

    def delete_file(self, tenant_id: str, file_id: str) -> None:
        """Delete one of the tenant's files. Its batches go on: their unfinished items keep
        their bodies (:func:`backfill.store.bodies.keep_bodies`, same transaction)."""
        with self._db.transaction() as conn:
            owned = conn.execute(text(OWNED_FILE), {"i": file_id, "t": tenant_id}).first()
            gone = keep_bodies(conn, [file_id]) if owned is not None else []
            if gone:
                conn.execute(text(DELETE_FILES), {"ids": gone})
        if not gone:
            raise NotFound(f"No such File object: {file_id}")
