"""The layers import only downwards (docs/ARCHITECTURE.md, "Layers").

Every module of every layer is parsed, and every import counts: at the top, inside a function
(the lazy imports of the command line), under ``TYPE_CHECKING``. A second check imports the
whole core in a fresh interpreter and looks for frameworks pulled in indirectly. A third
keeps the benchmarks (``bench``, run from a checkout, not in the wheel) out of every package a
wheel installs. The dev kit (``devkit``: ``backfill dev``, the dev engine, the harnesses) is
imported by no production package, and by the command line only inside its commands.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import backfill

ROOT = Path(__file__).resolve().parents[2]

FRAMEWORKS = ("fastapi", "starlette", "celery", "kombu", "vllm", "uvicorn")
"""What the core never imports: it must run (and be tested) without a web server, a task
queue or an inference engine."""

FORBIDDEN: dict[str, tuple[str, ...]] = {
    # The domain and its rules: depends on nothing above it.
    "backfill": (
        *FRAMEWORKS,
        "worker",
        "queue_api",
        "backfill_cli",
        "backfill_analysis",
        "migrations",
        "devkit",
    ),
    # The API talks to engines through the core's engine client, never through the worker;
    # the schema is migrated by the command line, never by the API.
    "queue_api": ("worker", "backfill_cli", "migrations", "devkit"),
    # The worker talks to the API's state through Postgres and Redis only; it runs in
    # production, so nothing of the dev kit (a dev engine, embedded services) is in reach.
    "worker": ("queue_api", "backfill_cli", "devkit"),
    # Analysis tools (simulator, planner, lab) sit on the core; the API may use them (/lab).
    "backfill_analysis": (
        *FRAMEWORKS,
        "worker",
        "queue_api",
        "backfill_cli",
        "migrations",
        "devkit",
    ),
    "migrations": ("devkit",),
    # The engine's scheduler is a wheel of its own, installed into the engine's environment.
    "backfill_vllm": ("devkit",),
}
"""Top-level package -> the top-level packages none of its modules may import. The command
line (``backfill_cli``) is the one place that wires every layer together, so it has no row;
the dev kit (``devkit``) may import every production package, so it has none either."""

SHIPPED = (
    "backfill",
    "backfill_cli",
    "backfill_analysis",
    "queue_api",
    "worker",
    "devkit",
    "migrations",
    "backfill_vllm",
)
"""Every top-level package a wheel installs (``backfill_vllm`` is a wheel of its own)."""

BENCHMARKS = "bench"
"""Run from a checkout (``python -m bench.NAME``, the checkout on ``sys.path``), never installed."""

DEVKIT = "devkit"
"""What runs Backfill on one machine or in tests (``backfill dev``, the dev engine, embedded
services, harnesses): shipped, so ``backfill dev`` runs from an installed package, but never
loaded by a production process."""


@dataclass(frozen=True)
class Import:
    module: str
    """The importing module, dotted."""
    target: str
    """The imported module, dotted and absolute."""
    line: int


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str, module: str, *, is_package: bool = False) -> Iterator[Import]:
    """Every import statement in ``source`` (the module ``module``), anywhere in it."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            yield Import(module, target, node.lineno)


def package_imports(packages: Iterable[str]) -> Iterator[Import]:
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield from imports_of(
                path.read_text(encoding="utf-8"),
                _module_name(path),
                is_package=path.name == "__init__.py",
            )


def violations(found: Iterator[Import]) -> list[str]:
    bad = []
    for imp in found:
        layer = imp.module.split(".")[0]
        top = imp.target.split(".")[0]
        if top in FORBIDDEN.get(layer, ()):
            bad.append(f"{imp.module}:{imp.line} imports {imp.target}")
    return bad


def test_layers_import_only_what_they_may() -> None:
    found = list(package_imports(FORBIDDEN))
    assert any(i.module == "backfill.states" for i in found), "the core was not parsed"
    bad = violations(iter(found))
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_a_lazy_import_inside_a_function_counts() -> None:
    source = (
        "from __future__ import annotations\n"
        "def serve() -> None:\n"
        "    from worker.run import run_worker\n"
        "    import fastapi.responses\n"
        "    from . import sibling\n"
    )
    found = list(imports_of(source, "backfill.somewhere"))
    assert violations(iter(found)) == [
        "backfill.somewhere:3 imports worker.run",
        "backfill.somewhere:4 imports fastapi.responses",
    ]
    assert Import("backfill.somewhere", "backfill", 5) in found


def test_relative_imports_resolve_against_their_package() -> None:
    found = list(imports_of("from ..worker import x\n", "queue_api.routes.y"))
    assert found == [Import("queue_api.routes.y", "queue_api.worker", 1)]
    found = list(imports_of("from .engine import x\n", "backfill.sub", is_package=True))
    assert found == [Import("backfill.sub", "backfill.sub.engine", 1)]


def test_core_modules_pull_in_no_framework() -> None:
    # Importing every core module loads no framework, not even through a dependency.
    modules = [m.name for m in pkgutil.walk_packages(backfill.__path__, prefix="backfill.")]
    assert "backfill.states" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FRAMEWORKS!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"core imports frameworks: {out}"


def test_no_installed_package_imports_the_benchmarks() -> None:
    # The wheel leaves bench out, so an installed Backfill that imported it would fail on the
    # first call that reached the import, far from any checkout.
    found = list(package_imports(SHIPPED))
    assert any(i.module == "worker.dispatch" for i in found), "the worker was not parsed"
    bad = [
        f"{i.module}:{i.line} imports {i.target}"
        for i in found
        if i.target.split(".")[0] == BENCHMARKS
    ]
    assert not bad, "an installed package imports the benchmarks:\n" + "\n".join(bad)


def test_the_wheel_leaves_the_benchmarks_out() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    find = config["tool"]["setuptools"]["packages"]["find"]
    assert any(fnmatch("backfill", pattern) for pattern in find["include"])
    assert not any(fnmatch(BENCHMARKS, pattern) for pattern in find["include"]), find
    # Still type-checked with the rest.
    assert BENCHMARKS in config["tool"]["mypy"]["packages"]


def devkit_imports_outside_functions(source: str, module: str) -> list[int]:
    """Lines of ``source`` that import devkit when the module loads, not when a function runs."""
    tree = ast.parse(source)
    inside: set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            inside.update(ast.walk(node))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom) and node not in inside
        if any(i.target.split(".")[0] == DEVKIT for i in imports_of(ast.unparse(node), module))
    ]


def test_the_command_line_loads_devkit_only_inside_its_commands() -> None:
    # `backfill worker` and `backfill api` share the command line's modules with `backfill dev`:
    # one import of devkit at module level would load the dev kit into every production process.
    bad = []
    for path in sorted((ROOT / "backfill_cli").rglob("*.py")):
        module = _module_name(path)
        lines = devkit_imports_outside_functions(path.read_text(encoding="utf-8"), module)
        bad += [f"{module}:{line} imports {DEVKIT} at module level" for line in lines]
    assert not bad, "\n".join(bad)
    top_level = "import sys\nif sys.argv:\n    from devkit import dev\n"
    assert devkit_imports_outside_functions(top_level, "backfill_cli.x") == [3]
    assert devkit_imports_outside_functions("def dev() -> None:\n    import devkit\n", "x") == []


def test_the_wheel_ships_devkit_and_its_demo_documents() -> None:
    # `backfill dev` is README's first command: it runs from `pip install` as from a checkout.
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    find = config["tool"]["setuptools"]["packages"]["find"]
    assert any(fnmatch(DEVKIT, pattern) for pattern in find["include"]), find
    data = config["tool"]["setuptools"]["package-data"][DEVKIT]
    docs = [p.relative_to(ROOT / DEVKIT) for p in (ROOT / DEVKIT / "demo_docs").glob("*.txt")]
    assert docs, "the demo documents moved"
    assert all(any(fnmatch(str(d), pattern) for pattern in data) for d in docs), data
    assert DEVKIT in config["tool"]["mypy"]["packages"]
