"""The beat's word at start when retention purges would leave their space unused: Postgres
without autovacuum never reuses a purged row's space by itself (``bench.churn`` measured the
items table growing by a whole batch's size every round, to 1.8 GB, with 0 rows left)."""

from __future__ import annotations

from backfill.config import Settings
from backfill.maintenance import retention_warning


def test_retention_on_a_server_without_autovacuum_is_named_with_what_to_do() -> None:
    said = retention_warning(Settings(retention_s=86_400), autovacuum=False)
    assert said is not None
    assert "autovacuum off" in said
    assert "VACUUM items" in said


def test_nothing_to_say_with_autovacuum_on_or_retention_off() -> None:
    assert retention_warning(Settings(retention_s=86_400), autovacuum=True) is None
    assert retention_warning(Settings(retention_s=0), autovacuum=False) is None
