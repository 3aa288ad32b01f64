"""docs/configuration.md is written from the settings: every ``BACKFILL_*`` and
``BACKFILL_SCHED_*`` variable has a row, its default is the field's, its meaning the docstring
under the field, and a committed page that differs from what ``devkit.config_doc`` writes
fails here with the command that rewrites it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings, SettingsConfigDict

from backfill.config import Settings
from backfill_vllm.settings import SchedulerSettings
from devkit.config_doc import (
    COMMAND,
    ROOT,
    MissingMeaning,
    Row,
    attribute_docstrings,
    begin_marker,
    dataclass_rows,
    end_marker,
    model_rows,
    pages,
    shown_default,
    with_table,
)


def test_the_committed_pages_are_what_the_settings_write() -> None:
    for path, wanted in pages().items():
        committed = path.read_text(encoding="utf-8")
        assert committed == wanted, f"{path.relative_to(ROOT)} is stale: run {COMMAND}"


def test_every_setting_has_a_meaning_under_its_field() -> None:
    missing = [
        f"BACKFILL_{n.upper()}" for n, f in Settings.model_fields.items() if not f.description
    ]
    docs = attribute_docstrings(SchedulerSettings)
    missing += [
        f"BACKFILL_SCHED_{f.name.upper()}"
        for f in dataclasses.fields(SchedulerSettings)
        if not docs.get(f.name, "").strip()
    ]
    assert missing == [], f"settings with no docstring under their field: {missing}"


def test_every_variable_has_its_own_row_on_the_page() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = {line.split(" | ")[0].removeprefix("| ") for line in page.splitlines()}
    names = [f"`BACKFILL_{name.upper()}`" for name in Settings.model_fields]
    names += [f"`BACKFILL_SCHED_{f.name.upper()}`" for f in dataclasses.fields(SchedulerSettings)]
    missing = [name for name in names if name not in rows]
    assert missing == [], f"variables with no row of their own: {missing} (run {COMMAND})"


class _Told(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOY_", use_attribute_docstrings=True)

    told: int = 1
    """a meaning over two lines, with a pipe: a | b,
    joined into one row"""


class _Toy(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOY_", use_attribute_docstrings=True)

    told: int = 1
    """a setting with its meaning"""
    untold: int = 2


@dataclasses.dataclass(frozen=True)
class _ToyScheduler:
    told: bool = True
    """a flag with its meaning"""
    untold: float = 0.5


def test_a_setting_without_a_docstring_stops_the_page() -> None:
    with pytest.raises(MissingMeaning, match=r"_Toy\.untold has no meaning"):
        model_rows(_Toy, prefix="TOY_")
    with pytest.raises(MissingMeaning, match=r"_ToyScheduler\.untold has no meaning"):
        dataclass_rows(_ToyScheduler, "TOY_")
    assert attribute_docstrings(_ToyScheduler) == {"told": "a flag with its meaning"}


def test_a_meaning_is_one_row_whatever_its_lines() -> None:
    assert model_rows(_Told, prefix="TOY_") == [
        Row(
            "`TOY_TOLD`",
            "`1`",
            "a meaning over two lines, with a pipe: a \\| b, joined into one row",
        )
    ]


def test_defaults_are_shown_as_an_operator_reads_them() -> None:
    assert shown_default("max_file_bytes", 200 * 1024 * 1024) == "`209715200` (200 MiB)"
    assert shown_default("max_json_body_bytes", 64 * 1024) == "`65536` (64 KiB)"
    assert shown_default("max_line_bytes", 1000) == "`1000`"
    assert shown_default("retention_s", 30 * 86_400.0) == "`2592000` (30 days)"
    assert shown_default("webhooks_retry_for_s", 86_400.0) == "`86400` (1 day)"
    assert shown_default("lease_ttl_s", 30.0) == "`30`"
    assert shown_default("rate_limit_credit_hold_s", 0.25) == "`0.25`"
    assert shown_default("fair_share", True) == "`true`"
    assert shown_default("ahead_while_likely", False, flags=("0", "1")) == "`0`"
    assert shown_default("engine_api_key", None) == "unset"
    assert shown_default("media_tenants", "") == "empty"
    assert shown_default("broker_url", None) == "`BACKFILL_REDIS_URL`"


def test_a_table_is_rewritten_between_its_markers_and_the_prose_kept() -> None:
    text = f"# Page\n\nbefore\n\n{begin_marker('t')}\n| old |\n{end_marker('t')}\n\nafter\n"
    rows = [Row("`A`", "`1`", "a meaning")]
    written = with_table(text, "t", rows)
    assert written == (
        f"# Page\n\nbefore\n\n{begin_marker('t')}\n| variable | default | meaning |\n"
        f"|---|---|---|\n| `A` | `1` | a meaning |\n{end_marker('t')}\n\nafter\n"
    )
    with pytest.raises(ValueError, match="markers"):
        with_table("no markers here\n", "t", rows)


def test_a_page_is_read_from_the_root_it_is_given(tmp_path: Path) -> None:
    page = tmp_path / "docs" / "p.md"
    page.parent.mkdir()
    page.write_text(f"intro\n{begin_marker('settings')}\n{end_marker('settings')}\n")
    (written,) = pages(tmp_path, {"docs/p.md": ("settings",)}).values()
    assert written.startswith(f"intro\n{begin_marker('settings')}\n| variable |")
    assert "| `BACKFILL_LEASE_TTL_S` | `30` | a silent worker's items" in written
