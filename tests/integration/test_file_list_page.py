"""A page of ``GET /v1/files`` is written by Postgres, not by the API's interpreter.

OpenAI's default page is 10,000 files. Built in the API (rows fetched, records made, JSON
written) a page cost the one interpreter ~80-160 ms of CPU, and eight list loops of one tenant
raised another tenant's read p99 45-fold (``bench.isolation``, issue 35). Postgres writes the
page's JSON in its own process; the API passes the text on. The page is the same bytes as the
one the API wrote (``file_list_json``: the models' File list, field for field).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest
from batch_api_support import make_tenant
from sqlalchemy import text

from backfill.errors import InvalidInput
from backfill.store import Repository
from queue_api.schemas import file_list_json, file_page_json

NAMES = ["in.jsonl", 'résumé "quoted"\\\n\t\u2028✓\x01\x7f.jsonl', "", "/a/b<c>&.jsonl"]


def _store(repo: Repository, tenant_id: str, n: int, *, stamp: datetime | None = None) -> None:
    """``n`` files of the tenant's, two by two a second apart (the newest now), with awkward
    names, some expiring, some results of a job."""
    base = stamp or datetime.now(UTC)
    with repo.engine.begin() as conn:
        for i in range(n):
            conn.execute(
                text(
                    "INSERT INTO files (id, tenant_id, purpose, filename, bytes, job_id, "
                    "created_at, expires_at) VALUES (:i, :t, :p, :f, :b, :j, :c, :x)"
                ),
                {
                    "i": f"file-{tenant_id[-6:]}{i:06d}",
                    "t": tenant_id,
                    "p": "batch" if i % 3 else "batch_output",
                    "f": NAMES[i % len(NAMES)],
                    "b": i * 1000,
                    "j": None if i % 3 else "batch_x",
                    # Two by two in the same microsecond: the order breaks the tie by id.
                    "c": base - timedelta(seconds=i // 2, microseconds=(i // 2 * 7919) % 10**6),
                    "x": None if i % 2 else base + timedelta(days=30, microseconds=i),
                },
            )


def test_a_page_written_by_postgres_is_the_page_the_api_wrote_byte_for_byte(
    repo: Repository,
) -> None:
    tenant = make_tenant(repo, "lister")
    _store(repo, tenant.id, 25)
    asks: list[dict[str, object]] = [
        {"limit": 100},
        {"limit": 10},
        {"limit": 10, "ascending": True},
        {"limit": 7, "after": "file-" + tenant.id[-6:] + "000004"},
        {"limit": 7, "after": "file-" + tenant.id[-6:] + "000004", "ascending": True},
        {"limit": 5, "purpose": "batch_output"},
        {"limit": 5, "purpose": "nothing"},
        {"limit": 5, "after": "file-nosuch"},
    ]
    for ask in asks:
        page, more = repo.files.list_files(tenant.id, **ask)  # type: ignore[arg-type]
        want = file_list_json(page, more)
        got = file_page_json(repo.files.list_files_page(tenant.id, **ask))  # type: ignore[arg-type]
        assert got == want, ask
        assert json.loads(got) == json.loads(want)
    # Another tenant's files are not on it.
    other = make_tenant(repo, "other")
    assert json.loads(file_page_json(repo.files.list_files_page(other.id)))["data"] == []


def test_a_nul_byte_in_the_page_query_is_invalid_input(repo: Repository) -> None:
    tenant = make_tenant(repo, "nul")
    with pytest.raises(InvalidInput):
        repo.files.list_files_page(tenant.id, purpose="a\x00b")
    with pytest.raises(InvalidInput):
        repo.files.list_files_page(tenant.id, after="x\x00y")
