"""One vLLM server of the development engine: started in a process group of its own on a
provisioned model, ready once ``/health`` answers, stopped as a group; optionally with
Backfill's step scheduler from this checkout and its metrics on a port of their own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from devkit import harness
from devkit.devengine.errors import DevEngineError, say, tail
from devkit.devengine.models import MODELS, DtypeChoice, checkpoint_dtype, choose_dtype, cpu_flags
from devkit.devengine.provisioning import default_venv, install, offline_env, provision, venv_python

# A server that exits while starting is reported at once; this only bounds one that hangs.
# The tiny model is ready in ~25 s on a quiet 2-core machine and took 120 s at a load average
# of 8; a machine several times slower still gets there.
READY_TIMEOUT_S = 900.0


_WORKDIR_PREFIX = "backfill-engine-"
_PID_FILE = "server.pid"
# A dead server's folder is kept this long, so whoever started it can still read its log.
_STALE_WORKDIR_S = 120.0


# Backfill's step scheduler for vLLM (``backfill_vllm/``, a package of its own beside this
# one). The dev engine puts this checkout's copy on the engine's path; an operator installs it
# into the engine's environment instead (docs/engine-scheduler.md).
SCHEDULER_CLS = "backfill_vllm.scheduler.BackfillScheduler"
# Measured on SmolLM2-135M (2 cores, 2026-12-03): with a 0.1 s target an interactive prompt
# arriving beside a batch flood waited +0.10-0.15 s over alone, with 0.05 s +0.03-0.05 s, and
# batch throughput did not drop (178.5 vs 174.5 tok/s).
CPU_CHUNK_TARGET_S = "0.05"
_CHECKOUT = Path(__file__).resolve().parents[2]
_SCHEDULER_PACKAGE = _CHECKOUT / "backfill_vllm"
# Backfill's engine gate (``queue_api/engine_gate.py``): the interactive gateway inside vLLM's
# API server. The dev engine puts this checkout's packages on the engine's path (the engine
# venv holds the few packages they need beyond vLLM's: provisioning's ENGINE_GATE_PACKAGES).
GATE_MIDDLEWARE = "queue_api.engine_gate.EngineGate"
_GATE_PACKAGES = ("backfill", "queue_api", "backfill_vllm")


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
    api_key: str | None = None
    """The key its ``/v1`` routes take (vLLM's ``--api-key``); None: open to anyone."""
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
            return tail(self.log_path.read_text(errors="replace"), lines)
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
        # Children (the engine core) may outlive the API server's exit; the group is reaped.
        with contextlib.suppress(subprocess.TimeoutExpired):
            harness.stop(
                self.process,
                grace_s,
                group=True,
                kill_wait_s=5,
                on_overrun=lambda: say(
                    f"server {self.pid} ignored SIGTERM for {grace_s} s; killing"
                ),
            )
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
    api_key: str | None = None,
    scheduler: bool = False,
    scheduler_settings: Mapping[str, str] | None = None,
    gate_settings: Mapping[str, str] | None = None,
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

    With ``api_key`` its ``/v1`` routes answer only requests that carry it (vLLM's
    ``--api-key``, passed in the environment, not on a command line others can read).

    With ``scheduler`` the engine runs Backfill's step scheduler (``--scheduler-cls``), taken
    from this checkout, with ``scheduler_settings`` (``BACKFILL_SCHED_*`` variables) and its
    metrics on a free port (:attr:`EngineServer.scheduler_metrics_url`).

    With ``gate_settings`` (``BACKFILL_*`` variables: the deployment's stores,
    ``BACKFILL_GATE_NODE``, ``BACKFILL_ENGINE_API_KEY`` equal to ``api_key``) the engine runs
    Backfill's engine gate (``--middleware``), taken from this checkout.
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
    port = port or harness.free_port(host)
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
    if gate_settings is not None:
        argv += ["--middleware", GATE_MIDDLEWARE]
        sched_env.update(gate_settings)
        sched_env["PYTHONPATH"] = str(_checkout_path(workdir, _GATE_PACKAGES))
    argv += list(extra_args)
    env = offline_env(
        **sched_env,
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", omp_threads_bind()),
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        HF_HOME=str(workdir / "hf"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
    )
    env.pop("VLLM_API_KEY", None)
    if api_key:
        env["VLLM_API_KEY"] = api_key
    started = time.monotonic()
    process = harness.spawn(
        argv,
        log_path,
        env=env,
        cwd=workdir,
        log_mode="wb",
        death_signal=signal.SIGTERM if die_with_parent else None,
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
        api_key=api_key or None,
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
    say(
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
    own = {"BACKFILL_SCHED_METRICS_PORT", "BACKFILL_SCHED_METRICS_HOST"}
    env = {
        # A CPU engine's steps are ~10x a GPU's: the scheduler's default chunk target
        # (10 ms of batch prefill per step) would cut batch prefill into slivers here.
        "BACKFILL_SCHED_CHUNK_TARGET_S": CPU_CHUNK_TARGET_S,
        # This process' BACKFILL_SCHED_* variables win over that default (a benchmark's
        # sweep, an operator's setting), the caller's settings over both; the metrics port is
        # always a free one of ours.
        **{k: v for k, v in os.environ.items() if k.startswith("BACKFILL_SCHED_") and k not in own},
        "BACKFILL_SCHED_METRICS_PORT": str(harness.free_port(host)),
        "BACKFILL_SCHED_METRICS_HOST": host,
        **settings,
    }
    if (_SCHEDULER_PACKAGE / "scheduler.py").is_file():
        env["PYTHONPATH"] = str(_checkout_path(workdir, ("backfill_vllm",)))
    # Else the package must be installed in the engine's venv (pip install ./backfill_vllm).
    return env


def _checkout_path(workdir: Path, packages: Sequence[str]) -> Path:
    """A folder holding links to this checkout's ``packages`` only, for the engine's path (so
    nothing else of the checkout can shadow the engine's imports)."""
    path = workdir / "checkout-path"
    path.mkdir(exist_ok=True)
    for name in packages:
        link = path / name
        if not link.exists():
            link.symlink_to(_CHECKOUT / name, target_is_directory=True)
    return path


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
    with httpx.Client(timeout=5.0) as client:

        def healthy() -> bool:
            try:
                return client.get(f"{server.url}/health").status_code == 200
            except httpx.TransportError:
                return False

        try:
            harness.wait_ready(server.process, healthy, timeout_s, poll_s=0.5)
        except harness.ExitedWhileStarting as exc:
            raise DevEngineError(
                f"vLLM server exited with code {exc.returncode} while starting"
            ) from None
        except harness.NotReady:
            raise DevEngineError(f"vLLM server not healthy after {timeout_s:.0f} s") from None


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
