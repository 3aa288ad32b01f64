"""The core package imports no FastAPI, Celery or vLLM (checked in a fresh interpreter)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import backfill

FORBIDDEN = ("fastapi", "starlette", "celery", "kombu", "vllm", "uvicorn")


def test_core_modules_pull_in_no_framework() -> None:
    # Every module, the CLI included: it imports servers lazily, inside its commands.
    modules = [f"backfill.{m.name}" for m in pkgutil.iter_modules(backfill.__path__)]
    assert "backfill.store" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == "", f"core imports frameworks: {out}"
