"""The hot path's array parameters, sent as one literal (``array_literal``) instead of a list
psycopg dumps element by element, read back by Postgres as exactly the values sent."""

from __future__ import annotations

import psycopg
import pytest

from backfill.config import libpq_url
from backfill.store.driver import array_literal

AWKWARD = [
    "plain",
    "",
    "NULL",
    "null",
    'a "quoted" word',
    'back\\slash \\" both',
    "{braces}, commas, and spaces  ",
    " leading",
    "line\nbreak\ttab",
    "ünïcødé ✓ 中文",
    '{"id": "chatcmpl-1", "choices": [{"text": "\\\\n"}]}',
    None,
]


@pytest.mark.parametrize(
    ("values", "cast"),
    [
        (AWKWARD, "text[]"),
        ([], "text[]"),
        ([None], "text[]"),
        ([1, -2, 0, 2**62, None], "bigint[]"),
        ([7], "int[]"),
    ],
)
def test_postgres_reads_back_exactly_the_values_sent(
    database_url: str, values: list[object], cast: str
) -> None:
    with psycopg.connect(libpq_url(database_url)) as conn:
        row = conn.execute(f"SELECT CAST(%s AS {cast})", (array_literal(values),)).fetchone()  # type: ignore[arg-type]
    assert row is not None
    assert row[0] == values
