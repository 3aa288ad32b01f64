"""Tenants do not share the engine's prefix cache.

vLLM reuses the KV blocks of a prompt prefix it has seen, and a request that hits them starts
sooner: a tenant timing its own requests could tell whether another tenant sent a prompt
(a system prompt, a document). vLLM keys its prefix blocks by a request's ``cache_salt`` too,
so requests with different salts never share blocks. Backfill sets the salt of every
interactive request (the gateway) and every batch item's request but embeddings (the worker)
from its tenant, whatever the caller or the line sent: a tenant's own requests still share
their prefixes; two tenants' never do.
"""

from __future__ import annotations

import hashlib


def cache_salt(tenant_id: str) -> str:
    """The salt of ``tenant_id``'s requests (a digest: the engine's logs do not name it)."""
    return "bf-" + hashlib.sha256(f"backfill-tenant:{tenant_id}".encode()).hexdigest()[:32]
