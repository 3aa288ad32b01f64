"""What the retention purge's tests share: settings that keep a batch 30 days after it ends,
and a count of rows."""

from __future__ import annotations

from sqlalchemy import text

from backfill.config import Settings
from backfill.store import Repository


def kept_30_days(settings: Settings, **update: object) -> Settings:
    """``settings`` keeping a batch 30 days after it ends (``retention_s``), and ``update``."""
    return settings.model_copy(update={"retention_s": 30 * 86_400.0, **update})


def count_rows(repo: Repository, sql: str, **params: object) -> int:
    """The one number ``sql`` (a count) reads with ``params``."""
    with repo.engine.connect() as conn:
        return int(conn.execute(text(sql), params).scalar_one())
