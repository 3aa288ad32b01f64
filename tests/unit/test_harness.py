"""The process harness (devkit.harness) the dev tooling, the benchmarks and the tests share:
spawn, wait until ready, stop (with its group), a free port; over real child processes."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

from devkit import harness

# A child that leaves a grandchild in its group, says it is ready through a file, and waits.
READY_WITH_GRANDCHILD = """
import subprocess, sys, time
from pathlib import Path
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
Path(sys.argv[1]).write_text(str(grandchild.pid))
time.sleep(60)
"""
IGNORES_SIGTERM = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGTERM, signal.SIG_IGN)
Path(sys.argv[1]).write_text("up")
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); its state says it is gone.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_child_is_ready_when_it_answers_and_its_whole_group_goes_on_stop(tmp_path: Path) -> None:
    marker = tmp_path / "ready"
    proc = harness.spawn(
        [sys.executable, "-c", READY_WITH_GRANDCHILD, str(marker)], tmp_path / "child.log"
    )
    try:
        waited = harness.wait_ready(proc, marker.exists, 30, poll_s=0.05)
        assert waited < 30
        grandchild = int(marker.read_text())
        assert _alive(grandchild)
    finally:
        harness.stop(proc, 5, group=True)
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def test_a_child_that_exits_while_starting_is_reported_with_its_code(tmp_path: Path) -> None:
    proc = harness.spawn([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "child.log")
    with pytest.raises(harness.ExitedWhileStarting) as caught:
        harness.wait_ready(proc, lambda: False, 30, poll_s=0.05)
    assert caught.value.returncode == 3


def test_a_child_that_never_answers_is_not_ready_after_the_timeout(tmp_path: Path) -> None:
    proc = harness.spawn(
        [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "child.log"
    )
    try:
        started = time.monotonic()
        with pytest.raises(harness.NotReady):
            harness.wait_ready(proc, lambda: False, 0.3, poll_s=0.05)
        assert time.monotonic() - started < 10
        assert proc.poll() is None
    finally:
        harness.stop(proc, 5, group=True)


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    marker = tmp_path / "ready"
    proc = harness.spawn(
        [sys.executable, "-c", IGNORES_SIGTERM, str(marker)], tmp_path / "child.log"
    )
    harness.wait_ready(proc, marker.exists, 30, poll_s=0.05)
    overruns: list[None] = []
    harness.stop(proc, 0.3, on_overrun=lambda: overruns.append(None))
    assert proc.returncode == -signal.SIGKILL
    assert overruns == [None]


def test_the_log_holds_the_childs_output(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_bytes(b"earlier\n")
    proc = harness.spawn([sys.executable, "-c", "print('hello')"], log)
    assert proc.wait(30) == 0
    assert log.read_text() == "earlier\nhello\n"
    proc = harness.spawn([sys.executable, "-c", "print('again')"], log, log_mode="wb")
    assert proc.wait(30) == 0
    assert log.read_text() == "again\n"


def test_a_free_port_can_be_bound() -> None:
    port = harness.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_a_free_port_lies_below_the_ephemeral_range_and_is_bindable() -> None:
    # Was: the kernel's pick (bind to port 0), from the ephemeral range, which any outgoing
    # connection on the machine may take as its local port before the child binds it: an
    # engine's scheduler metrics, bound after its model loads, lost its port so in run 16.
    low = harness._ephemeral_low()
    ports = {harness.free_port() for _ in range(20)}
    assert all(low - harness.BELOW_EPHEMERAL <= p < low for p in ports), (low, sorted(ports))
    assert len(ports) > 1, "always the same port: concurrent starters would collide"
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port))
