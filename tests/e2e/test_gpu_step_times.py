"""``bench.gpu_step_times`` (run where a GPU is lent) on this machine's CPU, with the engine
venv's PyTorch (this venv has none): the decoder is one model whatever a step holds (its
``--check``), every step shape of the tiny grid is timed and written, and the simulator's cost
model is fitted to them."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from devkit import devengine

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_gpu_step_timer_runs_and_checks_its_decoder_on_a_cpu(tmp_path: Path) -> None:
    try:
        python = devengine.install().path
    except devengine.DevEngineError as exc:
        pytest.fail(f"could not provision the engine venv: {exc}", pytrace=False)
    out = tmp_path / "steps.json"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(
        [
            str(python), "-m", "bench.gpu_step_times", "--device", "cpu", "--model", "tiny",
            "--check", "--repeats", "2", "--out", str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )  # fmt: skip
    report = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, report
    assert "check: steps agree with their parts" in proc.stdout, report
    measured = json.loads(out.read_text())
    steps = measured["steps"]
    assert len(steps) == 9, steps
    assert all(s.get("eager_s", 0) > 0 and s["graph_s"] is None for s in steps), steps
    assert {s["decodes"] > 0 and s["prefill"] > 0 for s in steps} == {True, False}
    assert measured["environment"]["model"] == "tiny"
    # The closing line: the simulator's cost model fitted to the eager times (this CPU is
    # shared, so its verdict is not asserted, only that the fit ran: beside two busy loops the
    # times can be too noisy for any valid model, which the line then says).
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"gpu_step_times: fit_rms_relative_error=(\d+\.\d+ \(goal <= 0\.1\) (ok|short)|"
        r"nan \(goal <= 0\.1\) short \(.+\))",
        last,
    ), report
