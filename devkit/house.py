"""The house measured from the tree (issue 41, "Measure"): functions and modules of the
product over their size bounds. ``python -m devkit.house`` prints them;
``tests/unit/test_house_sizes.py`` fails on a function over the bound that does not say, in
its docstring, why it is not split.

Sizes are lines, from a function's ``def`` (decorators left out) to its last line, nested
functions counted in their parent as well; a module's are its lines.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRODUCT = ("backfill", "queue_api", "worker", "backfill_cli", "backfill_vllm")
"""The packages that ship (their ``tests`` folders left out)."""

MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 500

REASON_MARK = "Not split:"
"""How a long function's docstring states why it stays long: a sentence starting so."""


@dataclass(frozen=True, slots=True)
class Unit:
    """A function or module of the product, and its length in lines."""

    path: str
    line: int
    name: str
    lines: int
    reason: str | None = None
    """For a function: what its docstring gives after :data:`REASON_MARK`, if anything."""

    def __str__(self) -> str:
        return f"{self.lines:>4}  {self.path}:{self.line}  {self.name}"


def product_files(root: Path = ROOT, packages: Iterable[str] = PRODUCT) -> Iterator[Path]:
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "tests" not in path.relative_to(root).parts:
                yield path


def _reason(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    doc = ast.get_docstring(node) or ""
    at = doc.find(REASON_MARK)
    return " ".join(doc[at + len(REASON_MARK) :].split()) or None if at >= 0 else None


def functions(root: Path = ROOT, packages: Iterable[str] = PRODUCT) -> Iterator[Unit]:
    """Every function and method of the product, with its length."""
    for path in product_files(root, packages):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                yield Unit(
                    str(path.relative_to(root)),
                    node.lineno,
                    node.name,
                    node.end_lineno - node.lineno + 1,
                    _reason(node),
                )


def long_functions(
    root: Path = ROOT, packages: Iterable[str] = PRODUCT, limit: int = MAX_FUNCTION_LINES
) -> list[Unit]:
    """The product's functions over ``limit`` lines, longest first."""
    return sorted((u for u in functions(root, packages) if u.lines > limit), key=lambda u: -u.lines)


def long_modules(
    root: Path = ROOT, packages: Iterable[str] = PRODUCT, limit: int = MAX_MODULE_LINES
) -> list[Unit]:
    """The product's modules over ``limit`` lines, longest first."""
    sizes = (
        Unit(str(p.relative_to(root)), 1, p.stem, len(p.read_text().splitlines()))
        for p in product_files(root, packages)
    )
    return sorted((u for u in sizes if u.lines > limit), key=lambda u: -u.lines)


def main(argv: list[str] | None = None) -> int:
    del argv
    long = long_functions()
    print(f"functions over {MAX_FUNCTION_LINES} lines: {len(long)}")
    for unit in long:
        print(f"  {unit}" + (f"  (not split: {unit.reason})" if unit.reason else ""))
    modules = long_modules()
    print(f"modules over {MAX_MODULE_LINES} lines: {len(modules)}")
    for unit in modules:
        print(f"  {unit.lines:>4}  {unit.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
