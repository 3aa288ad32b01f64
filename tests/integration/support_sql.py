"""Reading the test's database directly, each read on a connection of its own; and settings
that keep a batch 30 days after it ends (the retention tests')."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Row, text

from backfill.config import Settings
from backfill.store import Repository


def query_rows(repo: Repository, sql: str, **params: object) -> Sequence[Row[Any]]:
    """The rows ``sql`` reads with ``params``."""
    with repo.engine.connect() as conn:
        return conn.execute(text(sql), params).all()


def query_one(repo: Repository, sql: str, **params: object) -> Row[Any]:
    """The one row ``sql`` reads with ``params`` (an error if there is not exactly one)."""
    with repo.engine.connect() as conn:
        return conn.execute(text(sql), params).one()


def count_rows(repo: Repository, sql: str, **params: object) -> int:
    """The one number ``sql`` (a count) reads with ``params``."""
    with repo.engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())


def kept_30_days(settings: Settings, **update: object) -> Settings:
    """``settings`` keeping a batch 30 days after it ends (``retention_s``), and ``update``."""
    return settings.model_copy(update={"retention_s": 30 * 86_400.0, **update})
