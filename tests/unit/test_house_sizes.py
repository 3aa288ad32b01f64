"""No product function over ``devkit.house.MAX_FUNCTION_LINES`` lines unless its docstring
says why it is not split (``Not split: ...``): a long function is split into a pure plan and
the thin code that carries it out, or it states its reason where the next reader looks.
No product module over ``devkit.house.MAX_MODULE_LINES`` lines but those :data:`LONG_MODULES`
names, each with the reason it is still long."""

from __future__ import annotations

from pathlib import Path

from devkit.house import (
    MAX_FUNCTION_LINES,
    MAX_MODULE_LINES,
    REASON_MARK,
    functions,
    long_functions,
    long_modules,
)

PENDING: dict[tuple[str, str], str] = {}
"""Long functions in files other work is changing now (issue 41): split, or given their
reason, once that work has landed; then they leave this list."""

LONG_MODULES: dict[str, str] = {}
"""Product modules over the bound, and why (issue 41): each leaves this list once split."""


def test_no_product_function_is_long_without_a_stated_reason() -> None:
    unexplained = [
        str(unit)
        for unit in long_functions()
        if unit.reason is None and (unit.path, unit.name) not in PENDING
    ]
    assert unexplained == [], (
        f"functions over {MAX_FUNCTION_LINES} lines: split them (a pure plan apart from the "
        f"code that carries it out), or say why not in the docstring ('{REASON_MARK} ...')"
    )


def test_the_pending_list_names_only_long_functions() -> None:
    long = {(unit.path, unit.name) for unit in long_functions()}
    assert set(PENDING) <= long, "a pending function was split: take it off PENDING"


def test_a_long_function_is_found_and_its_reason_read(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (package / "m.py").write_text(
        f"def long():\n{body}\n\n\n"
        f'def explained():\n    """Does one thing.\n\n    {REASON_MARK} one table,\n'
        f'    read top-down."""\n{body}\n\n\ndef short():\n    return 1\n'
    )
    found = {u.name: u for u in long_functions(tmp_path, ["pkg"])}
    assert set(found) == {"long", "explained"}
    assert found["long"].lines == MAX_FUNCTION_LINES + 1
    assert found["long"].reason is None
    assert found["explained"].reason == "one table, read top-down."
    assert {u.name for u in functions(tmp_path, ["pkg"])} == {"long", "explained", "short"}


def test_no_product_module_is_long_but_those_listed() -> None:
    long = [f"{unit.lines:>4}  {unit.path}" for unit in long_modules()]
    unlisted = [line for line in long if line.split()[-1] not in LONG_MODULES]
    assert unlisted == [], (
        f"modules over {MAX_MODULE_LINES} lines: split them by what each part owns (a seam "
        "named in the domain), not by line count"
    )


def test_the_long_module_list_names_only_long_modules() -> None:
    long = {unit.path for unit in long_modules()}
    assert set(LONG_MODULES) <= long, "a listed module is short now: take it off LONG_MODULES"


def test_a_long_module_is_found(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    (package / "short.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    found = long_modules(tmp_path, ["pkg"])
    assert [(u.path, u.lines) for u in found] == [("pkg/long.py", MAX_MODULE_LINES + 1)]
