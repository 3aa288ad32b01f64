"""The engine step scheduler's own tests (``backfill_vllm/tests``), run where they can run: with
the engine venv's python, which has vLLM (this venv has none). They drive
``BackfillScheduler`` with synthetic requests and no model; this test fails when they do."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from worker import devengine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_scheduler_passes_its_synthetic_request_tests_in_the_engine_venv() -> None:
    try:
        python = devengine.install().path
    except devengine.DevEngineError as exc:
        pytest.fail(f"could not provision the engine venv: {exc}", pytrace=False)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("BACKFILL_SCHED_")
    }
    proc = subprocess.run(
        [str(python), "-m", "unittest", "discover", "-s", "backfill_vllm/tests", "-t", "."],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    report = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"backfill_vllm's tests failed:\n{report}"
    ran = re.search(r"^Ran (\d+) tests?", proc.stderr, re.MULTILINE)
    assert ran is not None, report
    assert int(ran.group(1)) >= 15, report
    assert re.search(r"^OK\b", proc.stderr, re.MULTILINE), report
