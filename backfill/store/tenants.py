"""Tenants and their API keys: who may call, with what share and what quota.

Keys are stored by digest only; a key's first characters are its id, kept in clear to name
it in listings and revocations.
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import text

from backfill import ids
from backfill.errors import Conflict, InvalidInput, NotFound
from backfill.store.database import Database
from backfill.store.records import ApiKeyRecord, RevokedKey, TenantRecord

KEY_ID_CHARS = 11
"""A key's id is its first characters (``bf-`` and 8 random ones): stored in clear, shown
at creation and in listings, enough to name the key for revocation, useless to call with."""


def key_id(key: str) -> str:
    return key[:KEY_ID_CHARS]


def key_digest(key: str) -> str:
    """The stored form of an API key: its SHA-256 (keys are random, so no salt is needed)."""
    return hashlib.sha256(key.encode()).hexdigest()


# The columns of a TenantRecord, in its order (tenants aliased t).
TENANT_COLUMNS = "t.id, t.name, t.enqueued_token_quota, t.weight"

# A new tenant with its quota and weight (the id is made here).
CREATE_TENANT = (
    "INSERT INTO tenants (id, name, enqueued_token_quota, weight) VALUES (:i, :n, :q, :w)"
)

# One tenant by its unique name.
TENANT_BY_NAME = f"SELECT {TENANT_COLUMNS} FROM tenants t WHERE t.name = :n"

# One tenant by its id.
TENANT_BY_ID = f"SELECT {TENANT_COLUMNS} FROM tenants t WHERE t.id = :i"

# What a tenant keeps stored: its batches' items (every state) and its input files' bytes.
TENANT_STORED_ITEMS = (
    "SELECT coalesce(sum(c.total), 0) FROM jobs j JOIN job_counters c ON c.job_id = j.id "
    "WHERE j.tenant_id = :t"
)
TENANT_STORED_BYTES = (
    "SELECT coalesce(sum(bytes), 0) FROM files "
    "WHERE tenant_id = :t AND purpose = 'batch' AND job_id IS NULL"
)

# Change a tenant's share of the nodes; returns the tenant as it is now.
SET_TENANT_WEIGHT = f"UPDATE tenants t SET weight = :w WHERE t.name = :n RETURNING {TENANT_COLUMNS}"

# A new key, stored by digest; its prefix (the key's id) in clear.
CREATE_API_KEY = "INSERT INTO api_keys (tenant_id, digest, prefix) VALUES (:t, :d, :p)"

# The tenant a live (unrevoked) key belongs to: the check of every API call.
TENANT_FOR_KEY = (
    f"SELECT {TENANT_COLUMNS} FROM api_keys k "
    "JOIN tenants t ON t.id = k.tenant_id "
    "WHERE k.digest = :d AND k.revoked_at IS NULL"
)

# Live keys named by whole key (digest) or by id, locked so two revokes do not race.
LIVE_KEYS_MATCHING = (
    "SELECT k.id, k.digest, k.prefix, t.name FROM api_keys k "
    "JOIN tenants t ON t.id = k.tenant_id "
    "WHERE k.revoked_at IS NULL AND (k.digest = :d OR "
    "(char_length(:k) = :n AND k.prefix = :k)) FOR UPDATE OF k"
)

# Mark one key revoked now (rows are kept: listings show revoked keys).
REVOKE_KEY = "UPDATE api_keys SET revoked_at = now() WHERE id = :i"

# A tenant's keys by id, newest first.
TENANT_KEYS = (
    "SELECT prefix, created_at, revoked_at FROM api_keys WHERE tenant_id = :t "
    "ORDER BY created_at DESC, id DESC"
)


class Tenants:
    """Tenants and API keys."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def create_tenant(
        self, name: str, enqueued_token_quota: int | None = None, *, weight: float = 1.0
    ) -> TenantRecord:
        _check_weight(weight)
        tenant_id = ids.new_tenant_id()
        with self._db.transaction() as conn:
            conn.execute(
                text(CREATE_TENANT),
                {"i": tenant_id, "n": name, "q": enqueued_token_quota, "w": weight},
            )
        return TenantRecord(tenant_id, name, enqueued_token_quota, weight)

    def tenant_by_name(self, name: str) -> TenantRecord:
        return self._one_tenant(TENANT_BY_NAME, {"n": name}, f"no tenant named {name!r}")

    def tenant_by_id(self, tenant_id: str) -> TenantRecord:
        return self._one_tenant(TENANT_BY_ID, {"i": tenant_id}, f"no tenant {tenant_id!r}")

    def _one_tenant(self, query: str, params: dict[str, str], missing: str) -> TenantRecord:
        with self._db.transaction() as conn:
            row = conn.execute(text(query), params).first()
        if row is None:
            raise NotFound(missing)
        return TenantRecord(row[0], row[1], row[2], row[3])

    def stored_items(self, tenant_id: str) -> int:
        """Items of the tenant's batches stored now, whatever their state."""
        with self._db.transaction() as conn:
            return int(conn.execute(text(TENANT_STORED_ITEMS), {"t": tenant_id}).scalar_one())

    def stored_input_bytes(self, tenant_id: str) -> int:
        """Bytes of the tenant's input files stored now."""
        with self._db.transaction() as conn:
            return int(conn.execute(text(TENANT_STORED_BYTES), {"t": tenant_id}).scalar_one())

    def set_tenant_weight(self, name: str, weight: float) -> TenantRecord:
        """Change a tenant's share; claims follow it at once, API feasibility checks once
        the API's key cache refreshes."""
        _check_weight(weight)
        with self._db.transaction() as conn:
            row = conn.execute(
                text(SET_TENANT_WEIGHT),
                {"n": name, "w": weight},
            ).first()
        if row is None:
            raise NotFound(f"no tenant named {name!r}")
        return TenantRecord(row[0], row[1], row[2], row[3])

    def create_api_key(self, tenant_id: str) -> str:
        """Make a new key for the tenant; returns it in clear (the only time it exists so).
        Its first :data:`KEY_ID_CHARS` characters are its id (:func:`key_id`)."""
        key = f"bf-{secrets.token_urlsafe(32)}"
        with self._db.transaction() as conn:
            conn.execute(
                text(CREATE_API_KEY),
                {"t": tenant_id, "d": key_digest(key), "p": key_id(key)},
            )
        return key

    def tenant_for_key(self, key: str) -> TenantRecord | None:
        with self._db.transaction() as conn:
            row = conn.execute(
                text(TENANT_FOR_KEY),
                {"d": key_digest(key)},
            ).first()
        return None if row is None else TenantRecord(row[0], row[1], row[2], row[3])

    def revoke_api_key(self, key_or_id: str) -> RevokedKey:
        """Revoke one live key, named by the whole key or by its id (the first
        :data:`KEY_ID_CHARS` characters, as ``tenants create`` and ``tenants keys`` show).
        NotFound if no live key matches; Conflict if an id matches several (use the key)."""
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(LIVE_KEYS_MATCHING),
                {"d": key_digest(key_or_id), "k": key_or_id, "n": KEY_ID_CHARS},
            ).all()
            if not rows:
                raise NotFound("no live API key matches")
            if len(rows) > 1:
                raise Conflict(
                    f"{len(rows)} live keys have the id {key_or_id}; revoke by the whole key"
                )
            [(row_id, digest, prefix, tenant)] = rows
            conn.execute(text(REVOKE_KEY), {"i": row_id})
        return RevokedKey(prefix, digest, tenant)

    def api_keys(self, tenant_id: str) -> list[ApiKeyRecord]:
        """The tenant's keys (by id; the keys themselves are not kept), newest first."""
        with self._db.transaction() as conn:
            rows = conn.execute(
                text(TENANT_KEYS),
                {"t": tenant_id},
            ).all()
        return [ApiKeyRecord(*r) for r in rows]


def _check_weight(weight: float) -> None:
    if not weight > 0 or weight == float("inf"):
        raise InvalidInput(f"weight {weight} is not a positive number")
