"""Files: uploads stored in pieces by binary COPY, and output files rendered from a job's items.

A stored file of any size costs one piece of memory on the way in and on the way out.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import BinaryIO

import psycopg
from sqlalchemy import Connection, text

from backfill import ids
from backfill.errors import NotFound
from backfill.store.database import Store
from backfill.store.records import FileRecord

FILE_CHUNK_BYTES = 1024 * 1024
"""Pieces of stored files, unless the caller says (``Settings.file_chunk_bytes``)."""

# Stream the pieces of a file into file_chunks, binary (no text escaping of the bytes).
COPY_PIECES = "COPY file_chunks (file_id, seq, data) FROM STDIN (FORMAT BINARY)"
# A file uploaded before files were stored in pieces: its whole content, one value.
WHOLE_CONTENT = "SELECT content FROM files WHERE id = %s"
# One piece of a stored file, by its sequence number (read binary: see Store.read_binary).
PIECE = "SELECT data FROM file_chunks WHERE file_id = %s AND seq = %s"


def _copy_pieces(conn: Connection, file_id: str, source: BinaryIO, chunk_bytes: int) -> int:
    """COPY ``source`` into ``file_chunks`` a piece at a time; returns the bytes stored."""
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    size = seq = 0
    with (
        raw.cursor() as cur,
        cur.copy(COPY_PIECES) as copy,
    ):
        copy.set_types(["text", "int4", "bytea"])
        while piece := source.read(chunk_bytes):
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

# The bytes stored, once the COPY of the pieces is done.
SET_FILE_SIZE = "UPDATE files SET bytes = :b WHERE id = :i"

# Files that have not expired (an expired one is gone for its tenant before maintenance
# deletes it).
LIVE = "(expires_at IS NULL OR expires_at > now())"

# One of the tenant's files (another tenant's is not found).
GET_FILE = (
    "SELECT id, tenant_id, purpose, filename, bytes, job_id, created_at, expires_at "
    f"FROM files WHERE id = :i AND tenant_id = :t AND {LIVE}"
)

# A page of the tenant's files, of one purpose or all, newest (or oldest) first, after the
# cursor file ``:a`` (keyset on created_at, id: any page of any size costs one index range;
# a cursor that names no file of the tenant gives an empty page). One more than the page,
# to tell whether there is more.
LIST_FILES = {
    order: (
        "SELECT id, tenant_id, purpose, filename, bytes, job_id, created_at, expires_at "
        f"FROM files f WHERE tenant_id = :t AND {LIVE} "
        "AND (CAST(:p AS text) IS NULL OR purpose = :p) "
        "AND (CAST(:a AS text) IS NULL OR (f.created_at, f.id) "
        f"{cmp} (SELECT c.created_at, c.id FROM files c WHERE c.id = :a AND c.tenant_id = :t)) "
        f"ORDER BY created_at {order}, id {order} LIMIT :l"
    )
    for order, cmp in (("DESC", "<"), ("ASC", ">"))
}

# Files whose time is up, oldest first (maintenance deletes them; their pieces cascade).
DELETE_EXPIRED_FILES = (
    "DELETE FROM files WHERE id IN (SELECT id FROM files "
    "WHERE expires_at IS NOT NULL AND expires_at <= now() ORDER BY expires_at LIMIT :l) "
    "RETURNING id"
)

# Whether a file is stored in pieces, stored whole (from before pieces), or rendered.
FILE_KIND = (
    "SELECT job_id IS NULL AND bytes > 0, content IS NOT NULL FROM files "
    f"WHERE id = :i AND tenant_id = :t AND {LIVE}"
)

# Drop one of the tenant's files (its pieces go with it, ON DELETE CASCADE).
DELETE_FILE = "DELETE FROM files WHERE id = :i AND tenant_id = :t"


class Files(Store):
    """Stored and rendered files."""

    def create_file(
        self,
        tenant_id: str,
        purpose: str,
        filename: str,
        content: bytes | BinaryIO | None,
        *,
        size_bytes: int | None = None,
        job_id: str | None = None,
        chunk_bytes: int = FILE_CHUNK_BYTES,
        expires_after_s: int | None = None,
    ) -> FileRecord:
        """A file row; ``content`` (bytes, or a binary file read to its end) is stored in
        pieces of ``chunk_bytes`` by one binary COPY, so a file of any size costs one piece
        of memory. ``None``: a file rendered from ``job_id``'s items when read."""
        file_id = ids.new_file_id()
        source = io.BytesIO(content) if isinstance(content, bytes) else content
        size = size_bytes or 0
        with self._tx() as conn:
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
            if source is not None:
                size = _copy_pieces(conn, file_id, source, chunk_bytes)
                conn.execute(text(SET_FILE_SIZE), {"b": size, "i": file_id})
        return FileRecord(file_id, tenant_id, purpose, filename, size, job_id, row[0], row[1])

    def get_file(self, tenant_id: str, file_id: str) -> FileRecord:
        with self._tx() as conn:
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
        with self._tx() as conn:
            rows = conn.execute(
                text(LIST_FILES["ASC" if ascending else "DESC"]),
                {"t": tenant_id, "p": purpose, "a": after, "l": limit + 1},
            ).all()
        return [FileRecord(*r) for r in rows[:limit]], len(rows) > limit

    def delete_expired_files(self, limit: int = 1000) -> list[str]:
        """Delete files past their ``expires_at`` (up to ``limit``); returns their ids."""
        with self._tx() as conn:
            return list(conn.execute(text(DELETE_EXPIRED_FILES), {"l": limit}).scalars())

    def file_pieces(self, tenant_id: str, file_id: str) -> Iterator[bytes] | None:
        """A stored file's bytes, one piece per query (no connection is held between them),
        or None for a file rendered from a job's items. NotFound is raised at once, before
        the first piece is asked for."""
        with self._tx() as conn:
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

    def _pieces(self, file_id: str, legacy: bool) -> Iterator[bytes]:
        if legacy:
            # Uploaded before files were stored in pieces: one piece, the whole file.
            whole = self._read_binary(WHOLE_CONTENT, (file_id,))
            if whole is not None:
                yield whole
            return
        seq = 0
        while (piece := self._read_binary(PIECE, (file_id, seq))) is not None:
            yield piece
            seq += 1

    def delete_file(self, tenant_id: str, file_id: str) -> None:
        with self._tx() as conn:
            res = conn.execute(
                text(DELETE_FILE),
                {"i": file_id, "t": tenant_id},
            )
        if res.rowcount == 0:
            raise NotFound(f"No such File object: {file_id}")
