"""Provisioning the development engine, without installing or starting one: idempotence
markers, clean-up of abandoned server folders, and error messages that name the cause."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from devkit import devengine
from devkit.devengine import server as engine_server
from devkit.devengine.provisioning import ENGINE_GATE_PACKAGES, install_marker


def test_a_finished_install_is_reused_without_running_pip(tmp_path: Path) -> None:
    venv = tmp_path / "engine-venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    (venv / ".backfill-engine").write_text(install_marker())
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


def test_the_embedding_model_serves_the_tiny_checkpoint_with_the_pooling_runner(
    tmp_path: Path,
) -> None:
    python = tmp_path / "python"
    python.write_text("")
    built = tmp_path / "models" / "tiny"
    built.mkdir(parents=True)
    (built / ".backfill-model").write_text(devengine.MODELS["tiny"].build_id + "\n")
    result = devengine.build_model("tiny-embed", python=python, models_dir=tmp_path / "models")
    assert (result.reused, result.path) == (True, built)
    spec = devengine.MODELS["tiny-embed"]
    assert spec.embeds
    assert not devengine.MODELS["tiny"].embeds
    assert spec.serve_args == ("--runner", "pooling", "--convert", "embed")


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
    assert engine_server._root_cause(log) == "ValueError: To serve at least one request"
    assert engine_server._root_cause("all fine") == "(no exception in the log)"


def test_omp_binding_covers_the_cores_this_process_may_use() -> None:
    spec = devengine.omp_threads_bind()
    cores: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    assert cores == os.sched_getaffinity(0)


AVX2_EPYC_FLAGS = "fpu vme sse4_2 avx f16c avx2 bmi2 sha_ni"
AVX512_BF16_FLAGS = AVX2_EPYC_FLAGS + " avx512f avx512bw avx512vl avx512_bf16 avx512_vnni"


def test_a_bfloat16_model_is_served_in_float32_where_the_cpu_would_emulate_bfloat16() -> None:
    choice = devengine.choose_dtype("bfloat16", AVX2_EPYC_FLAGS.split())
    assert choice.dtype == "float32"
    assert "no native bfloat16" in choice.reason
    # AVX-512 alone does not compute bfloat16; the bf16 extension does.
    assert devengine.choose_dtype("bfloat16", ["avx512f", "avx512bw"]).dtype == "float32"
    assert devengine.choose_dtype("bfloat16", []).dtype == "float32"


def test_a_bfloat16_model_stays_bfloat16_where_the_cpu_computes_it_natively() -> None:
    assert devengine.choose_dtype("bfloat16", AVX512_BF16_FLAGS.split()).dtype == "bfloat16"
    amx = devengine.choose_dtype("bfloat16", [*AVX2_EPYC_FLAGS.split(), "amx_bf16", "amx_tile"])
    assert amx.dtype == "bfloat16"
    assert "amx_bf16" in amx.reason


def test_other_dtypes_are_served_as_saved() -> None:
    for saved in ("float32", "float16", "auto"):
        assert devengine.choose_dtype(saved, AVX2_EPYC_FLAGS.split()).dtype == saved


def test_cpu_flags_come_from_the_first_flags_line_of_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = (
        "processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
        f"flags\t\t: {AVX512_BF16_FLAGS}\nbugs\t\t: sysret_ss_attrs\n\n"
        f"processor\t: 1\nflags\t\t: {AVX2_EPYC_FLAGS}\n"
    )
    assert devengine.parse_cpu_flags(cpuinfo) == frozenset(AVX512_BF16_FLAGS.split())
    assert devengine.parse_cpu_flags("processor\t: 0\n") == frozenset()
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert "avx512_bf16" in devengine.cpu_flags(path)
    assert devengine.cpu_flags(tmp_path / "missing") == frozenset()


def test_the_checkpoint_dtype_is_read_from_its_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert devengine.checkpoint_dtype(tmp_path) == "bfloat16"
    (tmp_path / "config.json").write_text('{"text_config": {"dtype": "float32"}}')
    assert devengine.checkpoint_dtype(tmp_path) == "float32"
    (tmp_path / "config.json").write_text("{}")
    assert devengine.checkpoint_dtype(tmp_path) == "auto"
    assert devengine.checkpoint_dtype(tmp_path / "missing") == "auto"


def test_the_scheduler_env_puts_only_the_package_on_the_engines_path(tmp_path: Path) -> None:
    settings = {"BACKFILL_SCHED_RIDE_ALONG_SHARE": "0.2"}
    env = engine_server._scheduler_env(tmp_path, "127.0.0.1", settings)
    path = Path(env["PYTHONPATH"])
    assert sorted(p.name for p in path.iterdir()) == ["backfill_vllm"]
    assert (path / "backfill_vllm" / "scheduler.py").is_file()
    assert int(env["BACKFILL_SCHED_METRICS_PORT"]) > 0
    assert env["BACKFILL_SCHED_METRICS_HOST"] == "127.0.0.1"
    assert env["BACKFILL_SCHED_RIDE_ALONG_SHARE"] == "0.2"
    with pytest.raises(devengine.DevEngineError, match="BACKFILL_SCHED_"):
        engine_server._scheduler_env(tmp_path, "127.0.0.1", {"RIDE_ALONG": "1"})


def test_the_scheduler_env_takes_this_process_settings_over_the_cpu_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert (
        engine_server._scheduler_env(tmp_path, "127.0.0.1", {})["BACKFILL_SCHED_CHUNK_TARGET_S"]
        == engine_server.CPU_CHUNK_TARGET_S
    )
    monkeypatch.setenv("BACKFILL_SCHED_CHUNK_TARGET_S", "0.03")
    monkeypatch.setenv("BACKFILL_SCHED_METRICS_PORT", "1")
    env = engine_server._scheduler_env(tmp_path, "127.0.0.1", {})
    assert env["BACKFILL_SCHED_CHUNK_TARGET_S"] == "0.03"
    assert env["BACKFILL_SCHED_METRICS_PORT"] != "1"  # always a free port of its own
    given = {"BACKFILL_SCHED_CHUNK_TARGET_S": "0.2"}
    assert (
        engine_server._scheduler_env(tmp_path, "127.0.0.1", given)["BACKFILL_SCHED_CHUNK_TARGET_S"]
        == "0.2"
    )


def test_the_engine_gates_packages_are_pinned_as_the_product_pins_them() -> None:
    """The dev engine's venv gets the gate's packages within the ranges pyproject.toml gives
    the product, so the gate is tested against what an operator's `pip install backfill`
    resolves."""
    root = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]

    def name(spec: str) -> str:
        match = re.match(r"[A-Za-z0-9_.-]+(\[[^\]]*\])?", spec)
        assert match is not None
        return match.group(0)

    product = {name(d): d for d in deps}
    for spec in ENGINE_GATE_PACKAGES:
        assert product.get(name(spec)) == spec, f"{spec} is not pyproject.toml's {name(spec)}"
