"""Test modules are imported by their file name (the test folders are not packages): two of
one name in different layers break the collection of the whole suite ("import file
mismatch"), which a run of one layer does not show."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_name() -> None:
    by_name: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("test_*.py"):
        by_name[path.name].append(str(path.relative_to(TESTS)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert shared == {}, f"rename one of each: {shared}"
