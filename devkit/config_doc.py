"""The settings' tables of ``docs/configuration.md`` (and the step scheduler's on
``docs/engine-scheduler.md``), written from the settings themselves: each row's default is
the field's, its meaning the docstring under the field (``backfill/config/``,
``backfill_vllm/settings.py``). ``python -m devkit.config_doc`` rewrites the tables between
their markers and leaves the prose around them as it is; ``--check`` only says which pages
are stale. ``tests/unit/test_configuration_page.py`` fails when a committed page differs from
what this writes, or when a setting has no meaning.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from backfill.config import Settings
from backfill_vllm.settings import PREFIX as SCHEDULER_PREFIX
from backfill_vllm.settings import SchedulerSettings

ROOT = Path(__file__).resolve().parents[1]
COMMAND = "python -m devkit.config_doc"

SHOWN_DEFAULTS = {"broker_url": "`BACKFILL_REDIS_URL`"}
"""Defaults shown as something other than the field's value: ``None`` there means another
setting's value."""

_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
_SPANS = ((86_400, "day"), (3_600, "hour"))


class MissingMeaning(ValueError):
    """A setting has no docstring under its field: the page would show it without meaning."""


@dataclass(frozen=True, slots=True)
class Row:
    """One setting's row: its variable, its default as shown, and what it means."""

    variable: str
    default: str
    meaning: str


def shown_default(name: str, value: object, flags: tuple[str, str] = ("false", "true")) -> str:
    """``value`` as the page shows it: in backticks, bytes also in KiB/MiB/GiB and spans of
    seconds in hours or days where they come out whole; ``None`` is unset, ``""`` empty."""
    if name in SHOWN_DEFAULTS:
        return SHOWN_DEFAULTS[name]
    if value is None:
        return "unset"
    if value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{flags[value]}`"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    text = f"`{value}`"
    if isinstance(value, int):
        if "bytes" in name:
            for size, unit in _UNITS:
                if value >= size and value % size == 0:
                    return f"{text} ({value // size} {unit})"
        if name.endswith("_s"):
            for span, unit in _SPANS:
                if value >= span and value % span == 0:
                    count = value // span
                    return f"{text} ({count} {unit}{'s' if count > 1 else ''})"
    return text


def _meaning(owner: str, name: str, doc: str | None) -> str:
    if not doc or not doc.strip():
        raise MissingMeaning(
            f"{owner}.{name} has no meaning: write what it does in a docstring under the field"
        )
    return " ".join(inspect.cleandoc(doc).split("\n")).replace("|", "\\|")


def model_rows(model: type[BaseModel], prefix: str = "BACKFILL_") -> list[Row]:
    """A pydantic settings model's rows, in field order (its model_config must read
    attribute docstrings as descriptions)."""
    return [
        Row(
            f"`{prefix}{name.upper()}`",
            shown_default(name, field.default),
            _meaning(model.__name__, name, field.description),
        )
        for name, field in model.model_fields.items()
    ]


def attribute_docstrings(cls: type) -> dict[str, str]:
    """The string under each annotated attribute of ``cls``'s body, read from its source
    (what pydantic's ``use_attribute_docstrings`` reads; a dataclass has no such option)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else []
    docs: dict[str, str] = {}
    for field, after in itertools.pairwise(body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[field.target.id] = after.value.value
    return docs


def dataclass_rows(cls: type, prefix: str) -> list[Row]:
    """A settings dataclass's rows, in field order; flags shown as ``0``/``1``, as the
    environment gives them."""
    docs = attribute_docstrings(cls)
    return [
        Row(
            f"`{prefix}{field.name.upper()}`",
            shown_default(field.name, field.default, flags=("0", "1")),
            _meaning(cls.__name__, field.name, docs.get(field.name)),
        )
        for field in dataclasses.fields(cls)
    ]


def table(rows: Sequence[Row]) -> str:
    """The markdown table of ``rows``."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    lines += [f"| {row.variable} | {row.default} | {row.meaning} |" for row in rows]
    return "\n".join(lines)


def begin_marker(name: str) -> str:
    """The line before ``name``'s table on its page."""
    return f"<!-- {name}: written by `{COMMAND}` from the settings' docstrings; edit those -->"


def end_marker(name: str) -> str:
    """The line after ``name``'s table."""
    return f"<!-- end {name} -->"


def with_table(text: str, name: str, rows: Sequence[Row]) -> str:
    """``text`` with what lies between ``name``'s markers replaced by the table of ``rows``."""
    begin, end = begin_marker(name), end_marker(name)
    head, found, rest = text.partition(begin + "\n")
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"no {begin!r} ... {end!r} markers")
    return f"{head}{begin}\n{table(rows)}\n{end}{tail}"


def tables() -> dict[str, list[Row]]:
    """Each generated table by marker name: Backfill's settings, the step scheduler's."""
    return {
        "settings": model_rows(Settings),
        "scheduler settings": dataclass_rows(SchedulerSettings, SCHEDULER_PREFIX),
    }


PAGES = {
    "docs/configuration.md": ("settings", "scheduler settings"),
    "docs/engine-scheduler.md": ("scheduler settings",),
}
"""Each page with generated tables, and the tables it holds."""


def pages(root: Path = ROOT, pages: Mapping[str, Sequence[str]] = PAGES) -> dict[Path, str]:
    """Each page's text as it should be: its prose as committed, its tables written anew."""
    rows = tables()
    wanted: dict[Path, str] = {}
    for page, names in pages.items():
        path = root / page
        text = path.read_text(encoding="utf-8")
        for name in names:
            text = with_table(text, name, rows[name])
        wanted[path] = text
    return wanted


def stale(root: Path = ROOT) -> list[Path]:
    """The pages whose committed text differs from what the settings give."""
    return [path for path, text in pages(root).items() if path.read_text(encoding="utf-8") != text]


def main(argv: Sequence[str] = ()) -> int:
    """Rewrite the pages (``--check``: only list the stale ones; 1 when any is)."""
    if "--check" in argv:
        old = stale()
        for path in old:
            print(f"{path.relative_to(ROOT)} is stale: run {COMMAND}")
        return 1 if old else 0
    for path, text in pages().items():
        if path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
