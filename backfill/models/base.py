"""What every table shares: one declarative base, its constraint naming, timestamps with time
zones, and the SQL list of an enum's values that each state column's CHECK is built from."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from sqlalchemy import DateTime, MetaData
from sqlalchemy.orm import DeclarativeBase

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

TZ = DateTime(timezone=True)


def in_list(values: Iterable[StrEnum]) -> str:
    """``'a', 'b', ...``: the values, sorted, as a SQL list (for ``state IN (...)``)."""
    return ", ".join(f"'{v.value}'" for v in sorted(values, key=lambda s: s.value))


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
