"""The ``backfill`` command starts without the libraries its command does not use: a client
command (``summarize``, ``results``, ``status``) pays neither Redis's client, the settings'
validation (pydantic), Arrow, the HTML parser, the webhook sealing's cryptography nor the capacity
tools' metric parser at start-up; each loads inside the command (or the reader) that needs it.

Each check runs in a fresh interpreter: ``sys.modules`` there is what the command line pulled
in, nothing the test process had already imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEAVY = (
    "redis",
    "pydantic",
    "pydantic_settings",
    "pyarrow",
    "numpy",
    "bs4",
    "cryptography",
    "prometheus_client",
)
"""Each costs tens of milliseconds to import; none is used by a client command as a whole."""


def loaded_after(code: str) -> set[str]:
    """The ``HEAVY`` top-level packages in ``sys.modules`` after ``code`` ran in a fresh
    interpreter."""
    probe = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_command_line_starts_without_redis_arrow_or_the_html_parser() -> None:
    assert loaded_after("import backfill_cli.app") == set()


def test_reading_a_jsonl_source_loads_neither_arrow_nor_the_html_parser(tmp_path: Path) -> None:
    source = tmp_path / "docs.jsonl"
    source.write_text('{"id": "a", "text": "one"}\n{"id": "b", "text": "two"}\n')
    code = (
        "from pathlib import Path\n"
        "from backfill_cli.summary_commands import source_rows\n"
        f"rows = list(source_rows(Path({str(source)!r}), 'text', 'id'))\n"
        "assert len(rows) == 2, rows"
    )
    assert loaded_after(code) == set()


def test_a_folder_of_text_loads_the_html_parser_only_for_html(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("plain text")
    code = (
        "from pathlib import Path\n"
        "from backfill_cli.summary_commands import source_rows\n"
        f"rows = list(source_rows(Path({str(tmp_path)!r}), None, None))\n"
        "assert len(rows) == 1, rows"
    )
    assert loaded_after(code) == set()
    (tmp_path / "b.html").write_text("<p>marked up</p>")
    assert loaded_after(code.replace("== 1", "== 2")) == {"bs4"}


def test_a_parquet_source_and_parquet_results_still_load_arrow(tmp_path: Path) -> None:
    code = (
        "from pathlib import Path\n"
        "from backfill.summarize.writer import ResultsWriter\n"
        "from backfill_cli.summary_commands import source_rows\n"
        f"out = Path({str(tmp_path / 'out.parquet')!r})\n"
        "with ResultsWriter(out):\n"
        "    pass\n"
        "assert list(source_rows(out, 'summary', 'id')) == []"
    )
    assert loaded_after(code) == {"pyarrow", "numpy"}
