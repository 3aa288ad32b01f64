"""Every setting an operator can set is documented: each ``Settings`` field's variable
(``BACKFILL_<NAME>``) and each of the step scheduler's (``BACKFILL_SCHED_<NAME>``) is named,
in full, in README.md or a page of docs/."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from backfill.config import Settings
from backfill_vllm.settings import PREFIX, SchedulerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_is_named_in_the_documentation() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    text = "".join(page.read_text(encoding="utf-8") for page in pages)
    names = [f"BACKFILL_{name.upper()}" for name in Settings.model_fields]
    names += [f"{PREFIX}{f.name.upper()}" for f in dataclasses.fields(SchedulerSettings)]
    missing = [name for name in names if name not in text]
    assert missing == [], f"settings no page names (add them to docs/configuration.md): {missing}"
