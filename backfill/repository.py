"""The one gateway for SQL: every statement Backfill sends to Postgres is in this module.

Rules it keeps:
- Every state change is a guarded ``UPDATE ... WHERE state = ANY(sources)`` checked against
  ``backfill.states``; writes of a worker attempt also name the attempt number (and, once the
  item runs, the ledger's fencing token), so a stale attempt's late write matches no row.
  A single-item write that matches no row raises ``StaleWrite``; batch writes return the ids
  that applied.
- Per-job counters change in the same transaction as the items they count, and counter rows
  are always locked last and in job-id order, so concurrent writers cannot deadlock on them.
- Hot paths move rows in batches: COPY for ingest, ``FOR UPDATE SKIP LOCKED`` claims of many
  items at once, array-parameter updates for results.
- Claims share each node between tenants by weight (``backfill.fairshare`` decides, the claim
  statement carries the plan out), earliest deadline first within a tenant.
"""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, BinaryIO

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy import Connection, Engine, create_engine, text
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from backfill import fairshare, ids
from backfill.clock import HostClock, SharedClock
from backfill.errors import (
    Conflict,
    IllegalTransition,
    InvalidInput,
    NotFound,
    StaleWrite,
    StoreUnavailable,
)
from backfill.models import ACTIVE_SQL, CLAIMABLE_SQL
from backfill.states import (
    ITEM_ACTIVE,
    ITEM_CLAIMABLE,
    ITEM_TERMINAL,
    ITEM_TRANSITIONS,
    JOB_TRANSITIONS,
    AttemptOutcome,
    ItemState,
    JobState,
)
from backfill.webhooks.outbox import enqueue_batch_event

COUNTED_STATES: tuple[ItemState, ...] = tuple(ItemState)
# ``not_before`` from a delay in seconds (``:retry``, NULL: none), on Postgres' own clock: a
# worker's timestamp would carry its clock's error into every claim.
_NOT_BEFORE = "now() + make_interval(secs => CAST(:retry AS float8))"
COUNTER_SHARDS = 16

# ---------------------------------------------------------------------------------------------
# Records returned to callers (plain values; no ORM session escapes this module)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TenantRecord:
    id: str
    name: str
    enqueued_token_quota: int | None
    weight: float = 1.0
    """Share of each node's batch sequences relative to the other tenants with work."""


@dataclass(frozen=True, slots=True)
class ApiKeyRecord:
    key_id: str
    created_at: datetime
    revoked_at: datetime | None


@dataclass(frozen=True, slots=True)
class RevokedKey:
    key_id: str
    digest: str
    """What key caches know the key by (announced so every API process forgets it)."""
    tenant: str


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    tenant_id: str
    purpose: str
    filename: str
    size_bytes: int
    job_id: str | None
    created_at: datetime


@dataclass(frozen=True, slots=True)
class JobCounts:
    """Items per state and token totals of one job (the ``job_counters`` row)."""

    total: int = 0
    by_state: dict[ItemState, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    max_output_tokens: int = 0
    output_tokens: int = 0

    def count(self, state: ItemState) -> int:
        return self.by_state.get(state, 0)

    @property
    def finished(self) -> int:
        return sum(self.count(s) for s in ITEM_TERMINAL)

    @property
    def unfinished(self) -> int:
        return self.total - self.finished


@dataclass(frozen=True, slots=True)
class JobRecord:
    id: str
    tenant_id: str
    input_file_id: str
    endpoint: str
    model: str | None
    completion_window: str
    state: JobState
    deadline: datetime
    metadata: dict[str, Any] | None
    errors: list[dict[str, Any]] | None
    idempotency_key: str | None
    output_file_id: str | None
    error_file_id: str | None
    created_at: datetime
    timestamps: dict[str, datetime | None]
    counts: JobCounts


@dataclass(frozen=True, slots=True)
class FinishedTokenStats:
    """Token figures of the items that succeeded in one window (for the metrics)."""

    until: datetime
    """The window's end, by the database's clock: the next window starts here."""
    count: int
    prompt_sum: int
    output_sum: int
    prompt_le: list[int]
    """Items with at most each bound's prompt tokens (cumulative, as Prometheus buckets)."""
    output_le: list[int]


@dataclass(frozen=True, slots=True)
class NewItem:
    """One request line to store, as validated by the API."""

    line_no: int
    custom_id: str
    body: str
    max_output_tokens: int
    prompt_tokens: int | None = None
    reservation_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ClaimedItem:
    """An item handed to one worker attempt (state ``reserved``)."""

    id: int
    job_id: str
    attempt: int
    custom_id: str
    body: str
    deadline: datetime
    prompt_tokens: int | None
    max_output_tokens: int
    reservation_tokens: int | None
    preemptions: int
    partial_output: str | None
    partial_tokens: int
    endpoint: str
    deadline_left_s: float
    """Seconds to ``deadline`` at the claim, on Postgres' clock: what a worker judges the
    deadline by (its own clock may be off; the claim's age it measures on its monotonic one)."""


@dataclass(frozen=True, slots=True)
class Start:
    """A claimed item about to run under a ledger lease."""

    item_id: int
    attempt: int
    lease_id: str
    fencing_token: int
    reservation_tokens: int
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of a running attempt: success with a result, or failure with an error."""

    item_id: int
    attempt: int
    fencing_token: int
    state: ItemState  # SUCCEEDED or FAILED
    result: str | None = None
    error: str | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class ActiveLeaseRow:
    """An item held by a live attempt, as the ledger needs it for a rebuild."""

    item_id: int
    node: str
    attempt: int
    lease_id: str | None
    fencing_token: int | None
    reservation_tokens: int | None
    lease_expires_at: datetime | None
    deadline: datetime
    preemptions: int
    partial_tokens: int


@dataclass(frozen=True, slots=True)
class LostItem(ActiveLeaseRow):
    """An item the reaper took back from a silent attempt: requeued, or failed when its
    worker died under it as often as the attempt cap allows."""

    failed: bool = False


@dataclass(frozen=True, slots=True)
class ItemRecord:
    id: int
    job_id: str
    line_no: int
    custom_id: str
    state: ItemState
    attempt: int
    result: str | None
    error: str | None
    output_tokens: int | None
    preemptions: int


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    engine_url: str
    model: str | None
    num_blocks: int
    block_size: int
    interactive_reserve_tokens: int
    last_seen_at: datetime

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


def ensure_database(server_url: str, name: str) -> str:
    """Create database ``name`` on the server of ``server_url`` unless it exists; returns its
    URL (SQLAlchemy form). For the dev command and tools, not for request paths."""
    if not name.replace("_", "").isalnum():
        raise ValueError(f"database name must be letters, digits and underscores: {name!r}")
    with psycopg.connect(_libpq(server_url), autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server_url.rpartition('/')[0]}/{name}"


def _libpq(url: str) -> str:
    return "postgresql://" + url.partition("://")[2]


KEY_ID_CHARS = 11
"""A key's id is its first characters (``bf-`` and 8 random ones): stored in clear, shown
at creation and in listings, enough to name the key for revocation, useless to call with."""


def key_id(key: str) -> str:
    return key[:KEY_ID_CHARS]


def key_digest(key: str) -> str:
    """The stored form of an API key: its SHA-256 (keys are random, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


def _check_moves(sources: Iterable[ItemState], target: ItemState) -> list[str]:
    out = []
    for s in sources:
        if target not in ITEM_TRANSITIONS[s]:
            raise IllegalTransition(f"item {s} -> {target} is not in the state machine")
        out.append(s.value)
    return out


_JOB_TIMESTAMP = {
    JobState.IN_PROGRESS: "in_progress_at",
    JobState.FINALIZING: "finalizing_at",
    JobState.COMPLETED: "completed_at",
    JobState.FAILED: "failed_at",
    JobState.EXPIRED: "expired_at",
    JobState.CANCELLING: "cancelling_at",
    JobState.CANCELLED: "cancelled_at",
}

_COUNTER_COLUMNS = (
    "total",
    *(s.value for s in COUNTED_STATES),
    "prompt_tokens",
    "max_output_tokens",
    "output_tokens",
)
# A job's counters are spread over a few shard rows (see _add_to_counters); readers sum them.
_COUNTERS_JOIN = (
    "CROSS JOIN LATERAL (SELECT "
    + ", ".join(f"coalesce(sum({c}), 0)::bigint AS {c}" for c in _COUNTER_COLUMNS)
    + " FROM job_counters WHERE job_id = j.id) c"
)

_JOB_COLUMNS = (
    "j.id, j.tenant_id, j.input_file_id, j.endpoint, j.model, j.completion_window, j.state, "
    "j.deadline, j.metadata, j.errors, j.idempotency_key, j.output_file_id, j.error_file_id, "
    "j.created_at, j.in_progress_at, j.finalizing_at, j.completed_at, j.failed_at, "
    "j.expired_at, j.cancelling_at, j.cancelled_at, c.total, "
    + ", ".join(f"c.{s.value}" for s in COUNTED_STATES)
    + ", c.prompt_tokens, c.max_output_tokens, c.output_tokens"
)


def _job_from_row(row: Sequence[Any]) -> JobRecord:
    stamps = dict(zip(_JOB_TIMESTAMP.values(), row[14:21], strict=True))
    n = len(COUNTED_STATES)
    counts = JobCounts(
        total=row[21] or 0,
        by_state={s: (row[22 + i] or 0) for i, s in enumerate(COUNTED_STATES)},
        prompt_tokens=row[22 + n] or 0,
        max_output_tokens=row[23 + n] or 0,
        output_tokens=row[24 + n] or 0,
    )
    return JobRecord(
        id=row[0],
        tenant_id=row[1],
        input_file_id=row[2],
        endpoint=row[3],
        model=row[4],
        completion_window=row[5],
        state=JobState(row[6]),
        deadline=row[7],
        metadata=row[8],
        errors=row[9],
        idempotency_key=row[10],
        output_file_id=row[11],
        error_file_id=row[12],
        created_at=row[13],
        timestamps=stamps,
        counts=counts,
    )


FILE_CHUNK_BYTES = 1024 * 1024
"""Pieces of stored files, unless the caller says (``Settings.file_chunk_bytes``)."""


def _copy_pieces(conn: Connection, file_id: str, source: BinaryIO, chunk_bytes: int) -> int:
    """COPY ``source`` into ``file_chunks`` a piece at a time; returns the bytes stored."""
    raw = conn.connection.driver_connection
    assert isinstance(raw, psycopg.Connection)
    size = seq = 0
    with (
        raw.cursor() as cur,
        cur.copy("COPY file_chunks (file_id, seq, data) FROM STDIN (FORMAT BINARY)") as copy,
    ):
        copy.set_types(["text", "int4", "bytea"])
        while piece := source.read(chunk_bytes):
            copy.write_row((file_id, seq, piece))
            size += len(piece)
            seq += 1
    return size


class Repository:
    """Postgres access for every Backfill process. Thread-safe (a pooled SQLAlchemy engine).

    ``fair_share`` is how :meth:`claim` orders tenants: by weighted fair share of the node
    (the default), or, when False, earliest deadline first across all tenants (the order
    before tenants were shared; kept to compare against).
    """

    def __init__(
        self, engine: Engine, *, fair_share: bool = True, host_clock: HostClock = time.time
    ) -> None:
        self.engine = engine
        self.fair_share = fair_share
        # Postgres' clock, read here: stored timestamps are judged, and new ones computed, on
        # it (this host's clock, ``host_clock``, may be off).
        self._clock = SharedClock(host=host_clock)

    @classmethod
    def connect(
        cls, database_url: str, *, pool_size: int = 5, fair_share: bool = True
    ) -> Repository:
        engine = create_engine(database_url, pool_size=pool_size, max_overflow=pool_size)
        return cls(engine, fair_share=fair_share)

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def _tx(self, *, durable: bool = True) -> Iterator[Connection]:
        """One transaction; driver errors leave as Backfill's own types.

        ``durable=False`` commits without waiting for the WAL flush. Only for writes whose
        loss in a Postgres crash is harmless by design: a lost claim or start leaves the item
        claimable again (or rescued by the reaper), and the worker's fenced writes then fail
        as stale instead of doing harm. Results are always written durably.
        """
        try:
            with self.engine.begin() as conn:
                if not durable:
                    conn.exec_driver_sql("SET LOCAL synchronous_commit = off")
                yield conn
        except IntegrityError as exc:
            raise Conflict(str(exc.orig)) from exc
        except OperationalError as exc:
            raise StoreUnavailable(f"Postgres unavailable: {exc.orig}") from exc
        except DataError as exc:
            # A value Postgres cannot hold (a NUL byte in text, a number out of range) that
            # came from outside: the caller's input, not a fault of the store.
            raise InvalidInput(f"value refused: {exc.orig}") from exc
        except psycopg.DataError as exc:
            # The same, from the driver directly (COPY and binary reads bypass SQLAlchemy).
            raise InvalidInput(f"value refused: {exc}") from exc
        except psycopg.OperationalError as exc:
            # A connection lost under a driver-level call (COPY, binary reads).
            raise StoreUnavailable(f"Postgres unavailable: {exc}") from exc
        except PoolTimeout as exc:
            # Every pooled connection is busy: the store is there but has no room for this
            # caller now, which a retry a little later may find.
            raise StoreUnavailable(f"no Postgres connection free: {exc}") from exc
        except DBAPIError as exc:
            if exc.connection_invalidated:
                raise StoreUnavailable(f"Postgres connection lost: {exc.orig}") from exc
            raise

    def ping(self) -> None:
        with self._tx() as conn:
            conn.execute(text("SELECT 1"))

    def now(self) -> datetime:
        """The time on Postgres' clock, without a round trip (re-anchored every few seconds):
        what a process judges stored timestamps by and computes new ones from. Postgres out
        of reach: the last anchor goes on (``StoreUnavailable`` if there is none yet)."""
        if self._clock.due():
            try:
                self._clock.sync_blocking(self._database_time)
            except StoreUnavailable:
                if not self._clock.anchored:
                    raise
        return datetime.fromtimestamp(self._clock.now(), UTC)

    def _database_time(self) -> float:
        with self._tx() as conn:
            return float(
                conn.execute(text("SELECT EXTRACT(EPOCH FROM clock_timestamp())")).scalar_one()
            )

    # -----------------------------------------------------------------------------------------
    # Tenants and API keys
    # -----------------------------------------------------------------------------------------

    def create_tenant(
        self, name: str, enqueued_token_quota: int | None = None, *, weight: float = 1.0
    ) -> TenantRecord:
        _check_weight(weight)
        tenant_id = ids.new_tenant_id()
        with self._tx() as conn:
            conn.execute(
                text(
                    "INSERT INTO tenants (id, name, enqueued_token_quota, weight) "
                    "VALUES (:i, :n, :q, :w)"
                ),
                {"i": tenant_id, "n": name, "q": enqueued_token_quota, "w": weight},
            )
        return TenantRecord(tenant_id, name, enqueued_token_quota, weight)

    def tenant_by_name(self, name: str) -> TenantRecord:
        with self._tx() as conn:
            row = conn.execute(
                text(f"SELECT {_TENANT_COLUMNS} FROM tenants t WHERE t.name = :n"), {"n": name}
            ).first()
        if row is None:
            raise NotFound(f"no tenant named {name!r}")
        return TenantRecord(row[0], row[1], row[2], row[3])

    def set_tenant_weight(self, name: str, weight: float) -> TenantRecord:
        """Change a tenant's share; claims follow it at once, API feasibility checks once
        the API's key cache refreshes."""
        _check_weight(weight)
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE tenants t SET weight = :w WHERE t.name = :n "
                    f"RETURNING {_TENANT_COLUMNS}"
                ),
                {"n": name, "w": weight},
            ).first()
        if row is None:
            raise NotFound(f"no tenant named {name!r}")
        return TenantRecord(row[0], row[1], row[2], row[3])

    def create_api_key(self, tenant_id: str) -> str:
        """Make a new key for the tenant; returns it in clear (the only time it exists so).
        Its first :data:`KEY_ID_CHARS` characters are its id (:func:`key_id`)."""
        key = f"bf-{secrets.token_urlsafe(32)}"
        with self._tx() as conn:
            conn.execute(
                text("INSERT INTO api_keys (tenant_id, digest, prefix) VALUES (:t, :d, :p)"),
                {"t": tenant_id, "d": key_digest(key), "p": key_id(key)},
            )
        return key

    def tenant_for_key(self, key: str) -> TenantRecord | None:
        with self._tx() as conn:
            row = conn.execute(
                text(
                    f"SELECT {_TENANT_COLUMNS} FROM api_keys k "
                    "JOIN tenants t ON t.id = k.tenant_id "
                    "WHERE k.digest = :d AND k.revoked_at IS NULL"
                ),
                {"d": key_digest(key)},
            ).first()
        return None if row is None else TenantRecord(row[0], row[1], row[2], row[3])

    def revoke_api_key(self, key_or_id: str) -> RevokedKey:
        """Revoke one live key, named by the whole key or by its id (the first
        :data:`KEY_ID_CHARS` characters, as ``tenants create`` and ``tenants keys`` show).
        NotFound if no live key matches; Conflict if an id matches several (use the key)."""
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT k.id, k.digest, k.prefix, t.name FROM api_keys k "
                    "JOIN tenants t ON t.id = k.tenant_id "
                    "WHERE k.revoked_at IS NULL AND (k.digest = :d OR "
                    "(char_length(:k) = :n AND k.prefix = :k)) FOR UPDATE OF k"
                ),
                {"d": key_digest(key_or_id), "k": key_or_id, "n": KEY_ID_CHARS},
            ).all()
            if not rows:
                raise NotFound("no live API key matches")
            if len(rows) > 1:
                raise Conflict(
                    f"{len(rows)} live keys have the id {key_or_id}; revoke by the whole key"
                )
            [(row_id, digest, prefix, tenant)] = rows
            conn.execute(
                text("UPDATE api_keys SET revoked_at = now() WHERE id = :i"), {"i": row_id}
            )
        return RevokedKey(prefix, digest, tenant)

    def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        """The tenant's keys (by id; the keys themselves are not kept), newest first."""
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT prefix, created_at, revoked_at FROM api_keys WHERE tenant_id = :t "
                    "ORDER BY created_at DESC, id DESC"
                ),
                {"t": tenant_id},
            ).all()
        return [ApiKeyRecord(*r) for r in rows]

    # -----------------------------------------------------------------------------------------
    # Files
    # -----------------------------------------------------------------------------------------

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
    ) -> FileRecord:
        """A file row; ``content`` (bytes, or a binary file read to its end) is stored in
        pieces of ``chunk_bytes`` by one binary COPY, so a file of any size costs one piece
        of memory. ``None``: a file rendered from ``job_id``'s items when read."""
        file_id = ids.new_file_id()
        source = io.BytesIO(content) if isinstance(content, bytes) else content
        size = size_bytes or 0
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "INSERT INTO files (id, tenant_id, purpose, filename, bytes, job_id) "
                    "VALUES (:i, :t, :p, :f, :b, :j) RETURNING created_at"
                ),
                {"i": file_id, "t": tenant_id, "p": purpose, "f": filename, "b": size, "j": job_id},
            ).one()
            if source is not None:
                size = _copy_pieces(conn, file_id, source, chunk_bytes)
                conn.execute(
                    text("UPDATE files SET bytes = :b WHERE id = :i"), {"b": size, "i": file_id}
                )
        return FileRecord(file_id, tenant_id, purpose, filename, size, job_id, row[0])

    def get_file(self, tenant_id: str, file_id: str) -> FileRecord:
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "SELECT id, tenant_id, purpose, filename, bytes, job_id, created_at "
                    "FROM files WHERE id = :i AND tenant_id = :t"
                ),
                {"i": file_id, "t": tenant_id},
            ).first()
        if row is None:
            raise NotFound(f"No such File object: {file_id}")
        return FileRecord(*row)

    def list_files(
        self, tenant_id: str, *, purpose: str | None = None, limit: int = 100
    ) -> list[FileRecord]:
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, tenant_id, purpose, filename, bytes, job_id, created_at "
                    "FROM files WHERE tenant_id = :t "
                    "AND (CAST(:p AS text) IS NULL OR purpose = :p) "
                    "ORDER BY created_at DESC, id DESC LIMIT :l"
                ),
                {"t": tenant_id, "p": purpose, "l": limit},
            ).all()
        return [FileRecord(*r) for r in rows]

    def file_pieces(self, tenant_id: str, file_id: str) -> Iterator[bytes] | None:
        """A stored file's bytes, one piece per query (no connection is held between them),
        or None for a file rendered from a job's items. NotFound is raised at once, before
        the first piece is asked for."""
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "SELECT job_id IS NULL AND bytes > 0, content IS NOT NULL FROM files "
                    "WHERE id = :i AND tenant_id = :t"
                ),
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
            whole = self._read_binary("SELECT content FROM files WHERE id = %s", (file_id,))
            if whole is not None:
                yield whole
            return
        seq = 0
        while (
            piece := self._read_binary(
                "SELECT data FROM file_chunks WHERE file_id = %s AND seq = %s", (file_id, seq)
            )
        ) is not None:
            yield piece
            seq += 1

    def _read_binary(self, query: str, params: tuple[Any, ...]) -> bytes | None:
        """One bytea value read in binary format: a text-format read hex-encodes it,
        doubling what crosses the wire and costing seconds to decode for 100 MB."""
        with self._tx() as conn:
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            with raw.cursor(binary=True) as cur:
                found = cur.execute(query, params).fetchone()
        return None if found is None or found[0] is None else bytes(found[0])

    def delete_file(self, tenant_id: str, file_id: str) -> None:
        with self._tx() as conn:
            res = conn.execute(
                text("DELETE FROM files WHERE id = :i AND tenant_id = :t"),
                {"i": file_id, "t": tenant_id},
            )
        if res.rowcount == 0:
            raise NotFound(f"No such File object: {file_id}")

    # -----------------------------------------------------------------------------------------
    # Nodes
    # -----------------------------------------------------------------------------------------

    def upsert_node(
        self,
        name: str,
        engine_url: str,
        model: str | None,
        num_blocks: int,
        block_size: int,
        interactive_reserve_tokens: int,
    ) -> None:
        with self._tx() as conn:
            conn.execute(
                text(
                    "INSERT INTO nodes (name, engine_url, model, num_blocks, block_size, "
                    "interactive_reserve_tokens) VALUES (:n, :u, :m, :b, :s, :r) "
                    "ON CONFLICT (name) DO UPDATE SET engine_url = EXCLUDED.engine_url, "
                    "model = EXCLUDED.model, num_blocks = EXCLUDED.num_blocks, "
                    "block_size = EXCLUDED.block_size, "
                    "interactive_reserve_tokens = EXCLUDED.interactive_reserve_tokens, "
                    "last_seen_at = now()"
                ),
                {
                    "n": name,
                    "u": engine_url,
                    "m": model,
                    "b": num_blocks,
                    "s": block_size,
                    "r": interactive_reserve_tokens,
                },
            )

    def touch_node(self, name: str) -> None:
        with self._tx() as conn:
            conn.execute(text("UPDATE nodes SET last_seen_at = now() WHERE name = :n"), {"n": name})

    def nodes(self) -> list[NodeRecord]:
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT name, engine_url, model, num_blocks, block_size, "
                    "interactive_reserve_tokens, last_seen_at FROM nodes ORDER BY name"
                )
            ).all()
        return [NodeRecord(*r) for r in rows]

    # -----------------------------------------------------------------------------------------
    # Jobs
    # -----------------------------------------------------------------------------------------

    def create_job(
        self,
        tenant_id: str,
        input_file_id: str,
        endpoint: str,
        completion_window: str,
        deadline: datetime,
        *,
        metadata: dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        model: str | None = None,
        state: JobState = JobState.VALIDATING,
    ) -> JobRecord:
        """A new job with its counters row. Reusing an idempotency key returns the first job."""
        job_id = ids.new_job_id()
        with self._tx() as conn:
            inserted = conn.execute(
                text(
                    "INSERT INTO jobs (id, tenant_id, input_file_id, endpoint, model, "
                    "completion_window, state, deadline, metadata, idempotency_key) "
                    "VALUES (:i, :t, :f, :e, :m, :w, :s, :d, :md, :k) "
                    "ON CONFLICT (tenant_id, idempotency_key) "
                    "WHERE idempotency_key IS NOT NULL DO NOTHING RETURNING id"
                ),
                {
                    "i": job_id,
                    "t": tenant_id,
                    "f": input_file_id,
                    "e": endpoint,
                    "m": model,
                    "w": completion_window,
                    "s": state.value,
                    "d": deadline,
                    "md": Jsonb(metadata) if metadata is not None else None,
                    "k": idempotency_key,
                },
            ).first()
            if inserted is None:
                existing = conn.execute(
                    text("SELECT id FROM jobs WHERE tenant_id = :t AND idempotency_key = :k"),
                    {"t": tenant_id, "k": idempotency_key},
                ).scalar_one()
                job_id = existing
            else:
                conn.execute(
                    text("INSERT INTO job_events (job_id, to_state) VALUES (:i, :s)"),
                    {"i": job_id, "s": state.value},
                )
        return self.get_job(tenant_id, job_id)

    def get_job(self, tenant_id: str | None, job_id: str) -> JobRecord:
        """The job with its counters; ``tenant_id=None`` only for internal callers."""
        with self._tx() as conn:
            row = conn.execute(
                text(
                    f"SELECT {_JOB_COLUMNS} FROM jobs j {_COUNTERS_JOIN} "
                    "WHERE j.id = :i AND (CAST(:t AS text) IS NULL OR j.tenant_id = :t)"
                ),
                {"i": job_id, "t": tenant_id},
            ).first()
        if row is None:
            raise NotFound(f"No such Batch object: {job_id}")
        return _job_from_row(row)

    def list_jobs(
        self, tenant_id: str, *, after: str | None = None, limit: int = 20
    ) -> list[JobRecord]:
        """Newest first; ``after`` is the id of the last job of the previous page."""
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    f"SELECT {_JOB_COLUMNS} FROM jobs j {_COUNTERS_JOIN} "
                    "WHERE j.tenant_id = :t AND (CAST(:a AS text) IS NULL OR "
                    "(j.created_at, j.id) < (SELECT created_at, id FROM jobs "
                    "WHERE id = :a AND tenant_id = :t)) "
                    "ORDER BY j.created_at DESC, j.id DESC LIMIT :l"
                ),
                {"t": tenant_id, "a": after, "l": limit},
            ).all()
        return [_job_from_row(r) for r in rows]

    def count_active_jobs(self, tenant_id: str) -> int:
        with self._tx() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT count(*) FROM jobs WHERE tenant_id = :t AND state IN "
                        "('validating', 'in_progress', 'finalizing', 'cancelling')"
                    ),
                    {"t": tenant_id},
                ).scalar_one()
            )

    def enqueued_tokens(self, tenant_id: str) -> int:
        """Worst-case tokens (prompt + max output) of the tenant's unfinished items."""
        with self._tx() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT coalesce(sum((c.prompt_tokens + c.max_output_tokens) "
                        "* (c.total - c.succeeded - c.failed - c.expired - c.cancelled) "
                        "/ greatest(c.total, 1)), 0) FROM jobs j "
                        f"{_COUNTERS_JOIN} WHERE j.tenant_id = :t "
                        "AND j.state IN ('validating', 'in_progress', 'cancelling')"
                    ),
                    {"t": tenant_id},
                ).scalar_one()
            )

    def move_job(
        self,
        job_id: str,
        target: JobState,
        *,
        reason: str | None = None,
        errors: list[dict[str, Any]] | None = None,
        output_file_id: str | None = None,
        error_file_id: str | None = None,
    ) -> JobState:
        """Guarded job transition; returns the state it left. ``StaleWrite`` if not allowed now."""
        with self._tx() as conn:
            return _move_job(
                conn,
                job_id,
                target,
                reason=reason,
                errors=errors,
                output_file_id=output_file_id,
                error_file_id=error_file_id,
            )

    def job_events(self, job_id: str) -> list[tuple[str | None, str, str | None]]:
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT from_state, to_state, reason FROM job_events WHERE job_id = :i "
                    "ORDER BY id"
                ),
                {"i": job_id},
            ).all()
        return [(r[0], r[1], r[2]) for r in rows]

    def jobs_in_state(self, state: JobState, limit: int = 100) -> list[str]:
        with self._tx() as conn:
            return list(
                conn.execute(
                    text("SELECT id FROM jobs WHERE state = :s ORDER BY deadline LIMIT :l"),
                    {"s": state.value, "l": limit},
                ).scalars()
            )

    def jobs_past_deadline(self, limit: int = 100) -> list[str]:
        with self._tx() as conn:
            return list(
                conn.execute(
                    text(
                        "SELECT id FROM jobs WHERE state IN ('validating', 'in_progress') "
                        "AND deadline <= now() ORDER BY deadline LIMIT :l"
                    ),
                    {"l": limit},
                ).scalars()
            )

    def recover_validating(
        self, created_before: datetime, errors: list[dict[str, Any]], limit: int = 100
    ) -> dict[str, JobState]:
        """Move on the ``validating`` jobs created before ``created_before`` whose create is
        gone (its API process died): a job whose items are stored goes on to
        ``in_progress`` (the COPY is all or nothing, so they are all there), any other
        fails with ``errors``. A live create holds its job's row for as long as it stores
        (see ``insert_items``), so ``SKIP LOCKED`` leaves it alone however long it takes;
        and one that somehow resumes later finds its job moved and stores nothing."""
        for target in (JobState.IN_PROGRESS, JobState.FAILED):
            if target not in JOB_TRANSITIONS[JobState.VALIDATING]:
                raise IllegalTransition(f"job validating -> {target} is not in the state machine")
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "WITH stale AS (SELECT j.id, EXISTS (SELECT 1 FROM items i "
                    "  WHERE i.job_id = j.id) AS stored FROM jobs j "
                    "  WHERE j.state = 'validating' AND j.created_at < :before "
                    "  ORDER BY j.created_at LIMIT :l FOR UPDATE OF j SKIP LOCKED), "
                    "moved AS (UPDATE jobs j SET "
                    "  state = CASE WHEN s.stored THEN 'in_progress' ELSE 'failed' END, "
                    "  in_progress_at = CASE WHEN s.stored THEN now() END, "
                    "  failed_at = CASE WHEN s.stored THEN NULL ELSE now() END, "
                    "  errors = CASE WHEN s.stored THEN j.errors ELSE :errors END "
                    "  FROM stale s WHERE j.id = s.id RETURNING j.id, j.state), "
                    "ev AS (INSERT INTO job_events (job_id, from_state, to_state, reason) "
                    "  SELECT id, 'validating', state, 'recovered from validating' FROM moved) "
                    "SELECT id, state FROM moved"
                ),
                {"before": created_before, "l": limit, "errors": Jsonb(errors)},
            ).all()
        return {r[0]: JobState(r[1]) for r in rows}

    # -----------------------------------------------------------------------------------------
    # Items: ingest
    # -----------------------------------------------------------------------------------------

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
        """
        with self._tx() as conn:
            row = conn.execute(
                text("SELECT deadline, state, tenant_id FROM jobs WHERE id = :i FOR KEY SHARE"),
                {"i": job_id},
            ).first()
            if row is None:
                raise NotFound(f"No such Batch object: {job_id}")
            deadline, tenant_id = row[0], row[2]
            if row[1] != JobState.VALIDATING.value:
                raise StaleWrite(f"job {job_id} is {row[1]}; its items are no longer wanted")
            raw = conn.connection.driver_connection
            assert isinstance(raw, psycopg.Connection)
            n = prompt_sum = max_out_sum = 0
            with (
                raw.cursor() as cur,
                cur.copy(
                    "COPY items (job_id, tenant_id, line_no, custom_id, body, "
                    "max_output_tokens, prompt_tokens, reservation_tokens, deadline) "
                    "FROM STDIN (FORMAT BINARY)"
                ) as copy,
            ):
                copy.set_types(
                    ["text", "text", "int4", "text", "text", "int4", "int4", "int4", "timestamptz"]
                )
                for it in items:
                    copy.write_row(
                        (
                            job_id,
                            tenant_id,
                            it.line_no,
                            it.custom_id,
                            it.body,
                            it.max_output_tokens,
                            it.prompt_tokens,
                            it.reservation_tokens,
                            deadline,
                        )
                    )
                    n += 1
                    prompt_sum += it.prompt_tokens or 0
                    max_out_sum += it.max_output_tokens
            _add_to_counters(
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
                _move_job(conn, job_id, JobState.IN_PROGRESS, reason=start_reason(n))
            else:
                state = conn.execute(
                    text("SELECT state FROM jobs WHERE id = :i FOR NO KEY UPDATE"),
                    {"i": job_id},
                ).scalar_one()
                if state != JobState.VALIDATING.value:
                    raise StaleWrite(f"job {job_id} is {state}; its items are no longer wanted")
        return n

    def set_prompt_tokens(self, counts: Sequence[tuple[int, int, int]]) -> None:
        """Record exact (item_id, prompt_tokens, reservation_tokens) after tokenization."""
        if not counts:
            return
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
                    "CAST(:p AS int[]), CAST(:r AS int[])) AS v(id, p, r)), "
                    "old AS (SELECT i.id, i.job_id, coalesce(i.prompt_tokens, 0) AS old_p "
                    "FROM items i JOIN v ON v.id = i.id FOR UPDATE OF i) "
                    "UPDATE items i SET prompt_tokens = v.p, reservation_tokens = v.r "
                    "FROM v, old WHERE i.id = v.id AND old.id = v.id "
                    "RETURNING i.job_id, v.p - old.old_p"
                ),
                {
                    "ids": [c[0] for c in counts],
                    "p": [c[1] for c in counts],
                    "r": [c[2] for c in counts],
                },
            ).all()
            deltas: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
            for job_id, delta in rows:
                deltas[job_id]["prompt_tokens"] += delta
            _add_to_counters(conn, deltas)

    # -----------------------------------------------------------------------------------------
    # Items: the worker's path
    # -----------------------------------------------------------------------------------------

    def claim(self, node: str, limit: int, lease_ttl_s: float) -> list[ClaimedItem]:
        """Hand up to ``limit`` claimable items to one attempt each, in the order to start them.

        With fair share (the default) the node's share view is read first, in the same
        transaction, and ``fairshare.claim_order`` plans whose items to take; the claim
        statement then takes each tenant's quota earliest deadline first, in the plan's
        order. With several tenants the plan asks for twice ``limit`` slots, so a tenant that
        has fewer items than its slots (all held by other nodes, or not due yet) passes its
        turn to the next tenant in fair order, and whatever is still short is filled earliest
        deadline first from every tenant: no claim comes back short while items wait.
        Without fair share, the earliest deadlines across all tenants.

        ``FOR UPDATE SKIP LOCKED`` lets many claimers run at once without ever handing one
        item to two of them; each claimed item's attempt number goes up by one, which fences
        out any older attempt's writes.
        """
        sources = _check_moves(ITEM_CLAIMABLE, ItemState.RESERVED)
        params: dict[str, Any] = {"n": limit, "node": node, "ttl": lease_ttl_s, "src": sources}
        with self._tx(durable=False) as conn:
            if self.fair_share:
                view = [
                    fairshare.TenantUse(r[0], float(r[1]), int(r[2]))
                    for r in conn.execute(text(_SHARE_VIEW), {"node": node}).all()
                ]
                # Spare slots only matter where a tenant short of items can pass its turn on.
                spare = limit if len(view) > 1 else 0
                params["slots"] = list(fairshare.claim_order(view, limit + spare))
                rows = conn.execute(text(_CLAIM_FAIR), params).all()
            else:
                rows = conn.execute(text(_CLAIM_EDF), params).all()
        return [
            ClaimedItem(
                id=r.id,
                job_id=r.job_id,
                attempt=r.attempt,
                custom_id=r.custom_id,
                body=r.body,
                deadline=r.deadline,
                prompt_tokens=r.prompt_tokens,
                max_output_tokens=r.max_output_tokens,
                reservation_tokens=r.reservation_tokens,
                preemptions=r.preemptions,
                partial_output=_decode_partial(r.partial_output),
                partial_tokens=r.partial_tokens,
                endpoint=r.endpoint,
                deadline_left_s=r.deadline_left_s,
            )
            for r in rows
        ]

    def start(
        self,
        item_id: int,
        attempt: int,
        *,
        lease_id: str,
        fencing_token: int,
        reservation_tokens: int,
        prompt_tokens: int,
        lease_ttl_s: float,
    ) -> None:
        """reserved -> running for one item; ``StaleWrite`` if its claim moved on."""
        start = Start(item_id, attempt, lease_id, fencing_token, reservation_tokens, prompt_tokens)
        if not self.start_many([start], lease_ttl_s):
            raise StaleWrite(f"item {item_id} attempt {attempt} no longer holds its claim")

    def start_many(self, starts: Sequence[Start], lease_ttl_s: float) -> list[int]:
        """reserved -> running, once each attempt holds a ledger lease that fits; returns the
        ids that applied (the others' claims moved on: their leases must be released)."""
        _check_moves([ItemState.RESERVED], ItemState.RUNNING)
        if not starts:
            return []
        with self._tx(durable=False) as conn:
            rows = conn.execute(
                text(
                    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
                    "CAST(:att AS int[]), CAST(:lid AS text[]), CAST(:fen AS bigint[]), "
                    "CAST(:res AS int[]), CAST(:pt AS int[])) AS v(id, a, l, f, r, p)), "
                    "moved AS (UPDATE items i SET state = 'running', lease_id = v.l, "
                    "  fencing_token = v.f, reservation_tokens = v.r, prompt_tokens = v.p, "
                    "  lease_expires_at = now() + make_interval(secs => :ttl), "
                    "  started_at = coalesce(i.started_at, now()), updated_at = now() "
                    "  FROM v WHERE i.id = v.id AND i.attempt = v.a AND i.state = 'reserved' "
                    "  RETURNING i.id, i.job_id, i.attempt, i.node, v.l, v.f, v.r, v.p), "
                    f"{_CNT_START}, "
                    "att AS (INSERT INTO attempts (item_id, attempt, node, lease_id, "
                    "  fencing_token, reserved_tokens, prompt_tokens) "
                    "  SELECT id, attempt, node, l, f, r, p FROM moved "
                    "  ON CONFLICT (item_id, attempt) DO UPDATE SET lease_id = EXCLUDED.lease_id, "
                    "  fencing_token = EXCLUDED.fencing_token, "
                    "  reserved_tokens = EXCLUDED.reserved_tokens, "
                    "  prompt_tokens = EXCLUDED.prompt_tokens) "
                    "SELECT id, job_id FROM moved"
                ),
                {
                    "ids": [x.item_id for x in starts],
                    "att": [x.attempt for x in starts],
                    "lid": [x.lease_id for x in starts],
                    "fen": [x.fencing_token for x in starts],
                    "res": [x.reservation_tokens for x in starts],
                    "pt": [x.prompt_tokens for x in starts],
                    "ttl": lease_ttl_s,
                },
            ).all()
        return [r.id for r in rows]

    def heartbeat(self, held: Sequence[tuple[int, int]], lease_ttl_s: float) -> list[int]:
        """Extend the claims of (item_id, attempt) pairs; returns the ids still held."""
        if not held:
            return []
        with self._tx() as conn:
            return list(
                conn.execute(
                    text(
                        "UPDATE items i SET lease_expires_at = now() + make_interval(secs => :t) "
                        "FROM unnest(CAST(:ids AS bigint[]), CAST(:att AS int[])) AS v(id, a) "
                        f"WHERE i.id = v.id AND i.attempt = v.a AND i.state IN ({ACTIVE_SQL}) "
                        "RETURNING i.id"
                    ),
                    {"t": lease_ttl_s, "ids": [h[0] for h in held], "att": [h[1] for h in held]},
                ).scalars()
            )

    def finish(self, finishes: Sequence[Finish]) -> list[int]:
        """running -> succeeded/failed for many items at once; returns the ids that applied.

        A finish whose attempt or fencing token no longer matches (the item was reaped,
        preempted or cancelled meanwhile) is dropped: the result is never written twice.
        """
        for f in finishes:
            if f.state not in (ItemState.SUCCEEDED, ItemState.FAILED):
                raise IllegalTransition(f"finish() writes succeeded or failed, not {f.state}")
        if not finishes:
            return []
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
                    "CAST(:att AS int[]), CAST(:fen AS bigint[]), CAST(:st AS text[]), "
                    "CAST(:res AS text[]), CAST(:err AS text[]), CAST(:out AS int[]), "
                    "CAST(:pt AS int[])) AS v(id, a, f, s, res, err, out, pt)), "
                    "moved AS (UPDATE items i SET state = v.s, result = v.res, error = v.err, "
                    "  output_tokens = v.out, prompt_tokens = coalesce(v.pt, i.prompt_tokens), "
                    "  lease_id = NULL, lease_expires_at = NULL, finished_at = now(), "
                    "  updated_at = now() FROM v WHERE i.id = v.id AND i.attempt = v.a "
                    "  AND i.fencing_token = v.f AND i.state = 'running' "
                    "  RETURNING i.id, i.job_id, i.attempt, v.s, v.out), "
                    f"{_CNT_FINISH}, "
                    "att AS (UPDATE attempts t SET ended_at = now(), outcome = m.s, "
                    "  output_tokens = m.out FROM moved m "
                    "  WHERE t.item_id = m.id AND t.attempt = m.attempt) "
                    "SELECT id, job_id, s, out FROM moved"
                ),
                {
                    "ids": [f.item_id for f in finishes],
                    "att": [f.attempt for f in finishes],
                    "fen": [f.fencing_token for f in finishes],
                    "st": [f.state.value for f in finishes],
                    "res": [f.result for f in finishes],
                    "err": [f.error for f in finishes],
                    "out": [f.output_tokens for f in finishes],
                    "pt": [f.prompt_tokens for f in finishes],
                },
            ).all()
        return [r.id for r in rows]

    def preempt(
        self,
        item_id: int,
        attempt: int,
        fencing_token: int,
        *,
        partial_output: str | None,
        partial_tokens: int,
    ) -> None:
        """running -> preempted: the engine request was aborted; keep its progress."""
        _check_moves([ItemState.RUNNING], ItemState.PREEMPTED)
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE items SET state = 'preempted', preemptions = preemptions + 1, "
                    "partial_output = :o, partial_tokens = :t, lease_id = NULL, "
                    "lease_expires_at = NULL, updated_at = now() "
                    "WHERE id = :i AND attempt = :a AND fencing_token = :f AND state = 'running' "
                    "RETURNING job_id"
                ),
                {
                    "i": item_id,
                    "a": attempt,
                    "f": fencing_token,
                    "o": _encode_partial(partial_output),
                    "t": partial_tokens,
                },
            ).first()
            if row is None:
                raise StaleWrite(f"item {item_id} attempt {attempt} is not running under it")
            _end_attempt(conn, item_id, attempt, AttemptOutcome.PREEMPTED, partial_tokens)
            _bump_counters(conn, [(row[0], ItemState.RUNNING, ItemState.PREEMPTED)])

    def give_back(
        self,
        item_id: int,
        attempt: int,
        target: ItemState,
        *,
        retry_after_s: float | None = None,
        detail: str | None = None,
    ) -> None:
        """reserved -> deferred (no slack) or queued (unstarted), claimable again
        ``retry_after_s`` from now on Postgres' clock (at once when None)."""
        if target not in (ItemState.DEFERRED, ItemState.QUEUED):
            raise IllegalTransition(f"give_back() moves to deferred or queued, not {target}")
        _check_moves([ItemState.RESERVED], target)
        outcome = (
            AttemptOutcome.DEFERRED if target is ItemState.DEFERRED else AttemptOutcome.RELEASED
        )
        with self._tx() as conn:
            row = conn.execute(
                text(
                    f"UPDATE items SET state = :s, not_before = {_NOT_BEFORE}, lease_id = NULL, "
                    "fencing_token = NULL, lease_expires_at = NULL, updated_at = now() "
                    "WHERE id = :i AND attempt = :a AND state = 'reserved' RETURNING job_id"
                ),
                {"i": item_id, "a": attempt, "s": target.value, "retry": retry_after_s},
            ).first()
            if row is None:
                raise StaleWrite(f"item {item_id} attempt {attempt} no longer holds its claim")
            _end_attempt(conn, item_id, attempt, outcome, None, detail)
            _bump_counters(conn, [(row[0], ItemState.RESERVED, target)])

    def unclaim(self, held: Sequence[tuple[int, int]], detail: str) -> list[int]:
        """reserved -> queued for many (item_id, attempt) claims given back unstarted (the
        slack could not take them); returns the ids that applied."""
        _check_moves([ItemState.RESERVED], ItemState.QUEUED)
        if not held:
            return []
        with self._tx(durable=False) as conn:
            rows = conn.execute(
                text(
                    "WITH v AS (SELECT * FROM unnest(CAST(:ids AS bigint[]), "
                    "CAST(:att AS int[])) AS v(id, a)), "
                    "moved AS (UPDATE items i SET state = 'queued', lease_id = NULL, "
                    "  fencing_token = NULL, lease_expires_at = NULL, updated_at = now() "
                    "  FROM v WHERE i.id = v.id AND i.attempt = v.a AND i.state = 'reserved' "
                    "  RETURNING i.id, i.job_id, i.attempt, i.node), "
                    f"{_CNT_UNCLAIM}, "
                    "att AS (INSERT INTO attempts (item_id, attempt, node, ended_at, outcome, "
                    "  detail) SELECT id, attempt, coalesce(node, ''), now(), 'released', :d "
                    "  FROM moved ON CONFLICT (item_id, attempt) DO NOTHING) "
                    "SELECT id FROM moved"
                ),
                {"ids": [h[0] for h in held], "att": [h[1] for h in held], "d": detail},
            ).all()
        return [r.id for r in rows]

    def fail(
        self, item_id: int, attempt: int, error: str, *, fencing_token: int | None = None
    ) -> None:
        """An attempt's item fails for good (bad request, retry cap reached)."""
        sources = [ItemState.RESERVED] if fencing_token is None else [ItemState.RUNNING]
        _check_moves(sources, ItemState.FAILED)
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE items SET state = 'failed', error = :e, lease_id = NULL, "
                    "lease_expires_at = NULL, finished_at = now(), updated_at = now() "
                    "WHERE id = :i AND attempt = :a AND state = :src "
                    "AND fencing_token IS NOT DISTINCT FROM :f RETURNING job_id"
                ),
                {
                    "i": item_id,
                    "a": attempt,
                    "e": error,
                    "src": sources[0].value,
                    "f": fencing_token,
                },
            ).first()
            if row is None:
                raise StaleWrite(f"item {item_id} attempt {attempt} no longer holds its claim")
            _end_attempt(conn, item_id, attempt, AttemptOutcome.FAILED, None, error)
            _bump_counters(conn, [(row[0], sources[0], ItemState.FAILED)])

    def requeue(
        self,
        item_id: int,
        attempt: int,
        fencing_token: int,
        *,
        partial_output: str | None,
        partial_tokens: int,
        detail: str,
        retry_after_s: float | None = None,
    ) -> None:
        """running -> queued: the attempt stopped (engine down, worker shutting down, lease
        lost, a worker error); its progress is kept for the next attempt, which waits
        ``retry_after_s`` from now (Postgres' clock) when given."""
        _check_moves([ItemState.RUNNING], ItemState.QUEUED)
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE items SET state = 'queued', partial_output = :o, partial_tokens = :t, "
                    "lease_id = NULL, fencing_token = NULL, lease_expires_at = NULL, "
                    f"not_before = {_NOT_BEFORE}, "
                    "updated_at = now() WHERE id = :i AND attempt = :a AND fencing_token = :f "
                    "AND state = 'running' RETURNING job_id"
                ),
                {
                    "i": item_id,
                    "a": attempt,
                    "f": fencing_token,
                    "o": _encode_partial(partial_output),
                    "t": partial_tokens,
                    "retry": retry_after_s,
                },
            ).first()
            if row is None:
                raise StaleWrite(f"item {item_id} attempt {attempt} is not running under it")
            _end_attempt(conn, item_id, attempt, AttemptOutcome.RELEASED, partial_tokens, detail)
            _bump_counters(conn, [(row[0], ItemState.RUNNING, ItemState.QUEUED)])

    def expire_claimed(self, item_id: int, attempt: int, reason: str) -> None:
        """reserved -> expired: the item cannot finish before its deadline, so it is not
        started at all (no prefill is spent on it)."""
        _check_moves([ItemState.RESERVED], ItemState.EXPIRED)
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "UPDATE items SET state = 'expired', error = :e, lease_id = NULL, "
                    "lease_expires_at = NULL, finished_at = now(), updated_at = now() "
                    "WHERE id = :i AND attempt = :a AND state = 'reserved' RETURNING job_id"
                ),
                {"i": item_id, "a": attempt, "e": reason},
            ).first()
            if row is None:
                raise StaleWrite(f"item {item_id} attempt {attempt} no longer holds its claim")
            _end_attempt(conn, item_id, attempt, AttemptOutcome.EXPIRED, None, reason)
            _bump_counters(conn, [(row[0], ItemState.RESERVED, ItemState.EXPIRED)])

    def next_ledger_epoch(self) -> int:
        """A ledger epoch larger than any handed out before (fencing tokens stay monotonic
        across a Redis data loss: each rebuild starts a new epoch)."""
        with self._tx() as conn:
            return int(
                conn.execute(
                    text(
                        "INSERT INTO ledger_epochs (id, epoch) VALUES (1, 1) ON CONFLICT (id) "
                        "DO UPDATE SET epoch = ledger_epochs.epoch + 1 RETURNING epoch"
                    )
                ).scalar_one()
            )

    def reap_lost(
        self, limit: int = 1000, *, max_lost_runs: int | None = None
    ) -> list[LostItem]:
        """Take back items whose attempt stopped heartbeating; returns them (to release their
        leases).

        An attempt lost while ``running`` means its worker process died with the request in
        the engine, which a poison request can cause every time: with ``max_lost_runs``, an
        item lost that many times while running fails ("worker lost N times") instead of
        being requeued. Attempts lost while ``reserved`` never reached the engine and do not
        count. (Started attempts are the ones whose ``attempts`` row has a fencing token.)
        """
        _check_moves(sorted(ITEM_ACTIVE), ItemState.QUEUED)
        _check_moves(sorted(ITEM_ACTIVE), ItemState.FAILED)
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "WITH lost AS (SELECT id, state, node, attempt, lease_id, fencing_token, "
                    "  reservation_tokens, lease_expires_at FROM items "
                    f"  WHERE state IN ({ACTIVE_SQL}) AND lease_expires_at < now() "
                    "  ORDER BY lease_expires_at LIMIT :l FOR UPDATE SKIP LOCKED), "
                    "runs AS (SELECT lost.id, (lost.state = 'running')::int + (SELECT count(*) "
                    "  FROM attempts a WHERE a.item_id = lost.id AND a.attempt < lost.attempt "
                    "  AND a.outcome = 'lost' AND a.fencing_token IS NOT NULL) AS n FROM lost), "
                    "fate AS (SELECT lost.*, runs.n AS lost_runs, "
                    "  (lost.state = 'running' AND runs.n >= CAST(:cap AS int)) IS TRUE AS failed "
                    "  FROM lost JOIN runs ON runs.id = lost.id), "
                    "moved AS (UPDATE items i SET "
                    "  state = CASE WHEN f.failed THEN 'failed' ELSE 'queued' END, "
                    "  error = CASE WHEN f.failed THEN json_build_object('code', 'worker_lost', "
                    "    'message', format('worker lost %s times while running this request "
                    "(its process died each time); it is not tried again', f.lost_runs))::text "
                    "    ELSE i.error END, "
                    "  finished_at = CASE WHEN f.failed THEN now() END, "
                    "  lease_id = NULL, fencing_token = NULL, lease_expires_at = NULL, "
                    "  updated_at = now() "
                    "  FROM fate f WHERE i.id = f.id "
                    "  RETURNING i.id, i.job_id, i.deadline, i.preemptions, i.partial_tokens, "
                    "  f.state AS from_state, f.node, f.attempt, f.lease_id, "
                    "  f.fencing_token, f.reservation_tokens, f.lease_expires_at, f.failed, "
                    "  f.lost_runs), "
                    "att AS (INSERT INTO attempts (item_id, attempt, node, ended_at, outcome, "
                    "  detail) SELECT id, attempt, coalesce(node, ''), now(), 'lost', "
                    "  CASE WHEN failed THEN format('worker lost %s times', lost_runs) END "
                    "  FROM moved ON CONFLICT (item_id, attempt) DO UPDATE SET "
                    "  ended_at = now(), outcome = 'lost', detail = EXCLUDED.detail) "
                    "SELECT * FROM moved"
                ),
                {"l": limit, "cap": max_lost_runs},
            ).all()
            _bump_counters(
                conn,
                [
                    (
                        r.job_id,
                        ItemState(r.from_state),
                        ItemState.FAILED if r.failed else ItemState.QUEUED,
                    )
                    for r in rows
                ],
            )
        return [LostItem(**_active_fields(r), failed=r.failed) for r in rows]

    def active_leases(self) -> list[ActiveLeaseRow]:
        """Every item a live attempt holds: what the ledger is rebuilt from."""
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, node, attempt, lease_id, fencing_token, reservation_tokens, "
                    "lease_expires_at, deadline, preemptions, partial_tokens FROM items "
                    f"WHERE state IN ({ACTIVE_SQL}) ORDER BY id"
                )
            ).all()
        return [ActiveLeaseRow(*r) for r in rows]

    def end_items(
        self, job_id: str, target: ItemState, *, only_unstarted: bool = False
    ) -> list[ActiveLeaseRow]:
        """Expire or cancel a job's unfinished items; returns the active ones it ended, so the
        caller can release their leases and abort their engine requests."""
        if target not in (ItemState.EXPIRED, ItemState.CANCELLED):
            raise IllegalTransition(f"end_items() moves to expired or cancelled, not {target}")
        states = set(ITEM_CLAIMABLE) if only_unstarted else set(ITEM_CLAIMABLE | ITEM_ACTIVE)
        sources = _check_moves(sorted(states), target)
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "WITH old AS (SELECT id, state, node, attempt, lease_id, fencing_token, "
                    "  reservation_tokens, lease_expires_at FROM items "
                    "  WHERE job_id = :j AND state = ANY(:src) FOR UPDATE), "
                    "moved AS (UPDATE items i SET state = :to, lease_id = NULL, "
                    "  lease_expires_at = NULL, finished_at = now(), updated_at = now() "
                    "  FROM old WHERE i.id = old.id "
                    "  RETURNING i.id, i.job_id, i.deadline, i.preemptions, i.partial_tokens, "
                    "  old.state AS from_state, old.node, old.attempt, old.lease_id, "
                    "  old.fencing_token, old.reservation_tokens, old.lease_expires_at), "
                    "att AS (INSERT INTO attempts (item_id, attempt, node, ended_at, outcome) "
                    "  SELECT id, attempt, coalesce(node, ''), now(), :to FROM moved "
                    "  WHERE from_state IN ('reserved', 'running') "
                    "  ON CONFLICT (item_id, attempt) DO UPDATE SET ended_at = now(), "
                    "  outcome = EXCLUDED.outcome) "
                    "SELECT * FROM moved"
                ),
                {"j": job_id, "src": sources, "to": target.value},
            ).all()
            _bump_counters(conn, [(r.job_id, ItemState(r.from_state), target) for r in rows])
        return [_active_row(r) for r in rows if ItemState(r.from_state) in ITEM_ACTIVE]

    # -----------------------------------------------------------------------------------------
    # Items: reads
    # -----------------------------------------------------------------------------------------

    def items(
        self,
        job_id: str,
        *,
        states: Iterable[ItemState] | None = None,
        after_line: int = -1,
        limit: int = 1000,
    ) -> list[ItemRecord]:
        """A page of a job's items in line order (results streaming, output files)."""
        state_list = [s.value for s in states] if states is not None else None
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, job_id, line_no, custom_id, state, attempt, result, error, "
                    "output_tokens, preemptions FROM items WHERE job_id = :j AND line_no > :a "
                    "AND (CAST(:s AS text[]) IS NULL OR state = ANY(:s)) "
                    "ORDER BY line_no LIMIT :l"
                ),
                {"j": job_id, "a": after_line, "s": state_list, "l": limit},
            ).all()
        return [
            ItemRecord(r[0], r[1], r[2], r[3], ItemState(r[4]), r[5], r[6], r[7], r[8], r[9])
            for r in rows
        ]

    def counted_states(self, job_id: str) -> dict[ItemState, int]:
        """COUNT(*) by state: the slow truth the counters are checked against."""
        with self._tx() as conn:
            rows = conn.execute(
                text("SELECT state, count(*) FROM items WHERE job_id = :j GROUP BY state"),
                {"j": job_id},
            ).all()
        return {ItemState(r[0]): int(r[1]) for r in rows}

    def backlog_tokens(self) -> int:
        """Worst-case tokens (prompt + max output) of every item not yet finished."""
        with self._tx() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT coalesce(sum(coalesce(prompt_tokens, 0) + max_output_tokens "
                        "- partial_tokens), 0) FROM items "
                        f"WHERE state IN ({CLAIMABLE_SQL}, {ACTIVE_SQL})"
                    )
                ).scalar_one()
            )

    def backlog_by_tenant(self) -> list[fairshare.TenantBacklog]:
        """:meth:`backlog_tokens` per tenant, with each tenant's weight (tenants with none
        are left out)."""
        with self._tx() as conn:
            rows = conn.execute(
                text(
                    "SELECT t.id, t.weight, b.tokens FROM (SELECT tenant_id, "
                    "sum(coalesce(prompt_tokens, 0) + max_output_tokens - partial_tokens) "
                    f"AS tokens FROM items WHERE state IN ({CLAIMABLE_SQL}, {ACTIVE_SQL}) "
                    "GROUP BY tenant_id) b JOIN tenants t ON t.id = b.tenant_id"
                )
            ).all()
        return [fairshare.TenantBacklog(r[0], float(r[1]), int(r[2])) for r in rows]

    # -----------------------------------------------------------------------------------------
    # Metrics (read at scrape time; each one cheap: counters, small tables, or an index range)
    # -----------------------------------------------------------------------------------------

    def item_state_totals(self) -> dict[ItemState, int]:
        """Items per state over every job, summed from the counters (no scan of items)."""
        states = list(ItemState)
        cols = ", ".join(f"coalesce(sum({s.value}), 0)" for s in states)
        with self._tx() as conn:
            row = conn.execute(text(f"SELECT {cols} FROM job_counters")).one()
        return {s: int(n) for s, n in zip(states, row, strict=True)}

    def job_state_totals(self) -> dict[JobState, int]:
        """Jobs per state (every state, zeros included)."""
        with self._tx() as conn:
            rows = conn.execute(text("SELECT state, count(*) FROM jobs GROUP BY state")).all()
        found = {JobState(r[0]): int(r[1]) for r in rows}
        return {s: found.get(s, 0) for s in JobState}

    def finished_token_stats(
        self,
        since: datetime | None,
        bounds: Sequence[int],
        *,
        lookback_s: float,
        lag_s: float,
    ) -> FinishedTokenStats:
        """Token figures of the items that succeeded after ``since`` (or, when None, in the
        last ``lookback_s``) and up to ``lag_s`` ago, by the database's clock.

        The upper end trails now by ``lag_s`` so that a finish committed a moment late (its
        ``finished_at`` is its transaction's start) still falls after the returned
        ``until``, which the caller passes back as the next ``since``.
        """
        wanted = [int(b) for b in bounds]
        buckets = ", ".join(
            f"count(i.id) FILTER (WHERE coalesce(i.{col}, 0) <= {b})"
            for col in ("prompt_tokens", "output_tokens")
            for b in wanted
        )
        with self._tx() as conn:
            row = conn.execute(
                text(
                    "WITH w AS (SELECT coalesce(CAST(:since AS timestamptz), "
                    "now() - make_interval(secs => :lookback)) AS lo, "
                    "now() - make_interval(secs => :lag) AS hi) "
                    "SELECT w.hi, count(i.id), coalesce(sum(i.prompt_tokens), 0), "
                    "coalesce(sum(i.output_tokens), 0)"
                    + (f", {buckets}" if buckets else "")
                    + " FROM w LEFT JOIN items i ON i.finished_at IS NOT NULL "
                    "AND i.finished_at > w.lo AND i.finished_at <= w.hi "
                    "AND i.state = 'succeeded' GROUP BY w.hi"
                ),
                {"since": since, "lookback": lookback_s, "lag": lag_s},
            ).one()
        n = len(wanted)
        return FinishedTokenStats(
            until=row[0],
            count=int(row[1]),
            prompt_sum=int(row[2]),
            output_sum=int(row[3]),
            prompt_le=[int(v) for v in row[4 : 4 + n]],
            output_le=[int(v) for v in row[4 + n : 4 + 2 * n]],
        )

    def output_tokens_finished_within(self, seconds: float) -> int:
        """Output tokens of the items that succeeded in the last ``seconds``."""
        with self._tx() as conn:
            return int(
                conn.execute(
                    text(
                        "SELECT coalesce(sum(output_tokens), 0) FROM items "
                        "WHERE finished_at IS NOT NULL "
                        "AND finished_at > now() - make_interval(secs => :s) "
                        "AND state = 'succeeded'"
                    ),
                    {"s": seconds},
                ).scalar_one()
            )

    # -----------------------------------------------------------------------------------------
    # The Batch API's lookups
    # -----------------------------------------------------------------------------------------

    def job_id_for_idempotency_key(self, tenant_id: str, idempotency_key: str) -> str | None:
        """The job a tenant already created with this key, if any (a retried create)."""
        with self._tx() as conn:
            return conn.execute(
                text("SELECT id FROM jobs WHERE tenant_id = :t AND idempotency_key = :k"),
                {"t": tenant_id, "k": idempotency_key},
            ).scalar()

    def jobs_with_all_items_finished(self, limit: int = 100) -> list[str]:
        """In-progress or finalizing jobs none of whose items is unfinished: ready to finalize.

        Asks the items (through the ``(job_id, state)`` index) rather than the counters, so a
        job is never finalized on a counter that drifted."""
        unfinished = [s.value for s in ItemState if s not in ITEM_TERMINAL]
        with self._tx() as conn:
            return list(
                conn.execute(
                    text(
                        "SELECT j.id FROM jobs j WHERE j.state IN ('in_progress', 'finalizing') "
                        "AND NOT EXISTS (SELECT 1 FROM items i WHERE i.job_id = j.id "
                        "AND i.state = ANY(:u)) ORDER BY j.deadline LIMIT :l"
                    ),
                    {"u": unfinished, "l": limit},
                ).scalars()
            )


def _move_job(
    conn: Connection,
    job_id: str,
    target: JobState,
    *,
    reason: str | None = None,
    errors: list[dict[str, Any]] | None = None,
    output_file_id: str | None = None,
    error_file_id: str | None = None,
) -> JobState:
    """``Repository.move_job`` inside the caller's transaction.

    The job row is locked ``FOR NO KEY UPDATE``: transitions of one job queue behind each
    other, but not behind a create that is storing the job's items (it holds the row
    ``FOR KEY SHARE`` for as long as it writes; see ``insert_items``)."""
    sources = [s.value for s, nexts in JOB_TRANSITIONS.items() if target in nexts]
    stamp = _JOB_TIMESTAMP.get(target)
    sets = ["state = :to"]
    if stamp:
        sets.append(f"{stamp} = now()")
    params: dict[str, Any] = {"i": job_id, "to": target.value, "src": sources}
    if errors is not None:
        sets.append("errors = :errors")
        params["errors"] = Jsonb(errors)
    if output_file_id is not None:
        sets.append("output_file_id = :of")
        params["of"] = output_file_id
    if error_file_id is not None:
        sets.append("error_file_id = :ef")
        params["ef"] = error_file_id
    row = conn.execute(
        text(
            "WITH old AS (SELECT id, state FROM jobs WHERE id = :i FOR NO KEY UPDATE) "
            f"UPDATE jobs j SET {', '.join(sets)} FROM old "
            "WHERE j.id = old.id AND old.state = ANY(:src) RETURNING old.state"
        ),
        params,
    ).first()
    if row is None:
        current = conn.execute(text("SELECT state FROM jobs WHERE id = :i"), {"i": job_id}).scalar()
        if current is None:
            raise NotFound(f"No such Batch object: {job_id}")
        raise StaleWrite(f"job {job_id} is {current}; cannot move to {target}")
    conn.execute(
        text(
            "INSERT INTO job_events (job_id, from_state, to_state, reason) "
            "VALUES (:i, :f, :t, :r)"
        ),
        {"i": job_id, "f": row[0], "t": target.value, "r": reason},
    )
    enqueue_batch_event(conn, job_id, target)
    return JobState(row[0])


def _active_fields(r: Any) -> dict[str, Any]:
    """ActiveLeaseRow's fields from a ``moved`` row of reap_lost() or end_items()."""
    return {
        "item_id": r.id,
        "node": r.node,
        "attempt": r.attempt,
        "lease_id": r.lease_id,
        "fencing_token": r.fencing_token,
        "reservation_tokens": r.reservation_tokens,
        "lease_expires_at": r.lease_expires_at,
        "deadline": r.deadline,
        "preemptions": r.preemptions,
        "partial_tokens": r.partial_tokens,
    }


def _active_row(r: Any) -> ActiveLeaseRow:
    return ActiveLeaseRow(**_active_fields(r))


def _encode_partial(text: str | None) -> str | None:
    # Model output may hold any code point, NUL included, which a Postgres text column
    # refuses; stored as a JSON string it round-trips exactly.
    return None if text is None else json.dumps(text)


def _decode_partial(stored: str | None) -> str | None:
    if stored is None:
        return None
    decoded = json.loads(stored)
    return decoded if isinstance(decoded, str) else None


def _end_attempt(
    conn: Connection,
    item_id: int,
    attempt: int,
    outcome: AttemptOutcome,
    output_tokens: int | None,
    detail: str | None = None,
) -> None:
    # An attempt row exists once the attempt started; one that ended unstarted (deferred,
    # released, failed validation) is recorded here for the first time.
    conn.execute(
        text(
            "INSERT INTO attempts (item_id, attempt, node, ended_at, outcome, output_tokens, "
            "detail) SELECT id, attempt, coalesce(node, ''), now(), :o, :t, :d FROM items "
            "WHERE id = :i ON CONFLICT (item_id, attempt) DO UPDATE SET ended_at = now(), "
            "outcome = EXCLUDED.outcome, output_tokens = EXCLUDED.output_tokens, "
            "detail = EXCLUDED.detail"
        ),
        {"i": item_id, "a": attempt, "o": outcome.value, "t": output_tokens, "d": detail},
    )


def _counters_cte(deltas: Mapping[str, str]) -> str:
    """A ``cnt`` CTE that adds aggregates over the ``moved`` CTE to the counters, inside the
    same statement (one round trip). ``deltas`` maps counter columns to aggregate
    expressions; only those columns are written. Rows are written in job-id order, the lock
    order every counter writer follows (see ``_add_to_counters``)."""
    cols = list(deltas)
    return (
        f"cnt AS (INSERT INTO job_counters (job_id, shard, {', '.join(cols)}) "
        f"SELECT job_id, pg_backend_pid() % {COUNTER_SHARDS}, {', '.join(deltas.values())} "
        "FROM moved GROUP BY job_id ORDER BY job_id ON CONFLICT (job_id, shard) DO UPDATE SET "
        + ", ".join(f"{c} = job_counters.{c} + EXCLUDED.{c}" for c in cols)
        + ")"
    )


def _moved_from(state: ItemState) -> str:
    return f"-count(*) FILTER (WHERE from_state = '{state.value}')"


_CNT_CLAIM = _counters_cte(
    {s.value: _moved_from(s) for s in sorted(ITEM_CLAIMABLE)} | {"reserved": "count(*)"}
)
_CNT_START = _counters_cte({"reserved": "-count(*)", "running": "count(*)"})
_CNT_UNCLAIM = _counters_cte({"reserved": "-count(*)", "queued": "count(*)"})
_CNT_FINISH = _counters_cte(
    {
        "running": "-count(*)",
        "succeeded": "count(*) FILTER (WHERE s = 'succeeded')",
        "failed": "count(*) FILTER (WHERE s = 'failed')",
        "output_tokens": "coalesce(sum(out), 0)",
    }
)


_TENANT_COLUMNS = "t.id, t.name, t.enqueued_token_quota, t.weight"

_CLAIMABLE_NOW = (
    f"state IN ({CLAIMABLE_SQL}) AND deadline > now() "
    "AND (not_before IS NULL OR not_before <= now()) "
    # Only a running job's items: never those of a job being validated, cancelled or
    # ended, whatever state its items were left in.
    "AND EXISTS (SELECT 1 FROM jobs jb WHERE jb.id = items.job_id AND jb.state = 'in_progress')"
)

# The tenants with work (jobs in progress; one whose items are all held elsewhere passes its
# slots on in the claim), their weights, and the batch sequences this node holds for each.
_SHARE_VIEW = (
    "WITH waiting AS (SELECT DISTINCT tenant_id FROM jobs WHERE state = 'in_progress'), "
    "held AS (SELECT tenant_id, count(*) AS n FROM items "
    f"  WHERE node = :node AND state IN ({ACTIVE_SQL}) GROUP BY tenant_id) "
    "SELECT t.id, t.weight, coalesce(h.n, 0) FROM waiting w "
    "JOIN tenants t ON t.id = w.tenant_id LEFT JOIN held h ON h.tenant_id = w.tenant_id"
)

# Moves the ``picked`` items to ``reserved`` for this attempt, counts them, and returns them
# in ``picked.ord`` order.
_CLAIM_MOVE = (
    "moved AS ("
    "  UPDATE items i SET state = 'reserved', attempt = i.attempt + 1, "
    "    node = :node, lease_id = NULL, fencing_token = NULL, not_before = NULL, "
    "    lease_expires_at = now() + make_interval(secs => :ttl), "
    "    updated_at = now() "
    "  FROM picked p WHERE i.id = p.id AND p.state = ANY(:src) "
    "  RETURNING i.id, i.job_id, i.attempt, i.custom_id, i.body, i.deadline, "
    "    i.prompt_tokens, i.max_output_tokens, i.reservation_tokens, "
    "    i.preemptions, i.partial_output, i.partial_tokens, p.state AS from_state, p.ord, "
    "    EXTRACT(EPOCH FROM (i.deadline - now()))::float8 AS deadline_left_s"
    f"), {_CNT_CLAIM} "
    "SELECT m.*, j.endpoint FROM moved m JOIN jobs j ON j.id = m.job_id ORDER BY m.ord"
)

_CLAIM_EDF = (
    "WITH picked AS ("
    "  SELECT id, state, row_number() OVER (ORDER BY deadline, id) AS ord FROM ("
    f"    SELECT id, state, deadline FROM items WHERE {_CLAIMABLE_NOW}"
    "    ORDER BY deadline, id LIMIT :n FOR UPDATE SKIP LOCKED) e), "
    + _CLAIM_MOVE
)

# ``:slots`` is the plan: the tenant of each slot, in order. The k-th slot of a tenant takes
# its k-th earliest-deadline item; the first ``:n`` slots that found one are the claim, and
# any shortfall is filled earliest deadline first across all tenants (``rest``). Items locked
# for slots past the first ``:n`` are not claimed and unlock at commit.
_CLAIM_FAIR = (
    "WITH slots AS ("
    "  SELECT s.tenant_id, s.ord, "
    "    row_number() OVER (PARTITION BY s.tenant_id ORDER BY s.ord) AS k "
    "  FROM unnest(CAST(:slots AS text[])) WITH ORDINALITY AS s(tenant_id, ord)), "
    "quota AS (SELECT tenant_id, count(*) AS n FROM slots GROUP BY tenant_id), "
    "taken AS ("
    "  SELECT q.tenant_id, c.id, c.state, "
    "    row_number() OVER (PARTITION BY q.tenant_id ORDER BY c.deadline, c.id) AS k "
    "  FROM quota q CROSS JOIN LATERAL ("
    "    SELECT id, state, deadline FROM items"
    f"    WHERE tenant_id = q.tenant_id AND {_CLAIMABLE_NOW}"
    "    ORDER BY deadline, id LIMIT q.n FOR UPDATE SKIP LOCKED) c), "
    "fair AS ("
    "  SELECT t.id, t.state, s.ord FROM taken t "
    "  JOIN slots s ON s.tenant_id = t.tenant_id AND s.k = t.k ORDER BY s.ord LIMIT :n), "
    "rest AS ("
    "  SELECT id, state, deadline FROM items"
    f"  WHERE {_CLAIMABLE_NOW} AND id <> ALL (ARRAY(SELECT id FROM taken))"
    "  ORDER BY deadline, id LIMIT greatest(0, :n - (SELECT count(*) FROM fair))"
    "  FOR UPDATE SKIP LOCKED), "
    "picked AS ("
    "  SELECT id, state, ord FROM fair UNION ALL "
    "  SELECT id, state, CAST(:n AS bigint) * 2 + row_number() OVER (ORDER BY deadline, id) "
    "  FROM rest), "
    + _CLAIM_MOVE
)


def _bump_counters(
    conn: Connection,
    moves: Sequence[tuple[str, ItemState, ItemState]],
    *,
    output_tokens: dict[str, int] | None = None,
) -> None:
    """Apply (job_id, from, to) item moves to the per-job counters."""
    deltas: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for job_id, source, target in moves:
        deltas[job_id][source.value] -= 1
        deltas[job_id][target.value] += 1
    for job_id, n in (output_tokens or {}).items():
        deltas[job_id]["output_tokens"] += n
    _add_to_counters(conn, deltas)


def _add_to_counters(conn: Connection, deltas: Mapping[str, Mapping[str, int]]) -> None:
    """Add column deltas to each job's counters.

    Every connection writes its own shard row of a job (``pg_backend_pid() % SHARDS``), so
    concurrent workers finishing items of one job do not queue on one row lock through each
    other's commits; readers sum the shards. Rows are touched in job-id order, the one lock
    order every writer follows, so writers cannot deadlock.
    """
    for job_id in sorted(deltas):
        cols = {c: d for c, d in deltas[job_id].items() if d}
        if not cols:
            continue
        names = sorted(cols)
        conn.execute(
            text(
                f"INSERT INTO job_counters (job_id, shard, {', '.join(names)}) "
                f"VALUES (:job, pg_backend_pid() % {COUNTER_SHARDS}, "
                + ", ".join(f":{c}" for c in names)
                + ") ON CONFLICT (job_id, shard) DO UPDATE SET "
                + ", ".join(f"{c} = job_counters.{c} + EXCLUDED.{c}" for c in names)
            ),
            {"job": job_id, **cols},
        )



def _check_weight(weight: float) -> None:
    if not weight > 0 or weight == float("inf"):
        raise InvalidInput(f"weight {weight} is not a positive number")
