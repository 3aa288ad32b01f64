"""Throwaway services and processes the reliability tests break on purpose.

The machine's own Postgres and Redis are shared with other runs: these tests never restart,
flush or reconfigure them. A scenario that kills Redis or Postgres starts its own instance on
a free port here and kills that one.

- :class:`RedisServer`: ``redis-server`` without persistence (a restart loses every key, as a
  Redis without AOF/RDB does after a crash).
- :class:`PostgresServer`: a fresh cluster (``initdb``) in a temporary folder, stopped with
  ``pg_ctl stop -m immediate`` (no shutdown checkpoint: it recovers from WAL on start, as
  after a crash). ``initdb`` refuses to run as root, so when the tests run as root the
  cluster is owned by, and every ``initdb``/``pg_ctl`` runs as, the ``postgres`` OS user.
- :class:`WorkerProcess`: a real ``backfill worker`` process, killed with SIGKILL, paused with
  SIGSTOP/SIGCONT, or stopped with SIGTERM.

Every process is started in a session of its own and is killed by the kernel if the test
process dies first, so a crashed test run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psycopg
import redis

from devkit import harness


def wait_until(cond: Callable[[], bool], timeout: float, what: str, poll: float = 0.05) -> float:
    """Poll ``cond`` until true; returns the seconds it took. AssertionError on timeout."""
    start = time.monotonic()
    while True:
        if cond():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def _spawn(
    argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    # SIGKILL, not SIGTERM, when the test process dies: nothing here needs a clean shutdown.
    return harness.spawn(argv, log, env=env, cwd=cwd, death_signal=signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# Redis


class RedisServer:
    """A Redis of the test's own, without persistence, on a fixed port across restarts."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or harness.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.proc = _spawn(
            [
                binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--daemonize", "no", "--maxmemory-policy", "noeviction",
                "--dir", str(self.workdir),
            ],
            self.workdir / "redis.log",
        )  # fmt: skip
        wait_until(self.ping, timeout, f"redis on port {self.port}")

    def ping(self) -> bool:
        client = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: every key is gone (no persistence)."""
        if self.proc is not None:
            harness.signal_group(self.proc)
            self.proc.wait(10)
            self.proc = None

    def restart(self) -> float:
        """kill -9, then start again on the same port; returns the seconds it was down."""
        t = time.monotonic()
        self.kill()
        self.start()
        return time.monotonic() - t

    def close(self) -> None:
        self.kill()


# ---------------------------------------------------------------------------------------------
# Postgres


def _postgres_bin() -> Path:
    root = Path("/usr/lib/postgresql")
    versions = sorted(
        (p for p in root.glob("*/bin") if (p / "initdb").exists()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not versions:
        found = shutil.which("initdb")
        if found is None:
            raise RuntimeError("no initdb found (PostgreSQL server binaries)")
        return Path(found).parent
    return versions[-1]


class PostgresServer:
    """A Postgres cluster of the test's own in ``workdir``, on a fixed port across restarts."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or harness.free_port()
        self.bin = _postgres_bin()
        self.data = workdir / "data"
        self.log = workdir / "postgres.log"
        self._as_postgres = os.geteuid() == 0
        self.admin_url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *argv: str, timeout: float = 120) -> None:
        cmd = list(argv)
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, timeout=timeout, check=False)
        if done.returncode != 0:
            out = (done.stdout + done.stderr).decode(errors="replace")
            raise RuntimeError(f"{' '.join(argv[:2])} failed ({done.returncode}): {out[-2000:]}")

    def init(self) -> None:
        if self._as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.workdir, pw.pw_uid, pw.pw_gid)
        self._run(
            str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
            "--no-sync", "-E", "UTF8",
        )  # fmt: skip

    def start(self, timeout: float = 60) -> None:
        # fsync off: the scenarios crash the server process (immediate stop), not the OS, so
        # the WAL in the page cache survives; it keeps the shared 2-core machine responsive.
        opts = (
            f"-p {self.port} -k {self.workdir} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c max_connections=200"
        )
        self._run(
            str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l", str(self.log),
            "-w", "-t", str(int(timeout)), "start",
        )  # fmt: skip

    def stop(self, mode: str = "immediate") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def create_database(self, name: str) -> str:
        """A new empty database; returns its SQLAlchemy URL."""
        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{self.port}/postgres", autocommit=True
        ) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop("immediate")


# ---------------------------------------------------------------------------------------------
# Workers


_STATS = re.compile(r"stopped: DispatchStats\((?P<fields>[^)]*)\)")


class WorkerProcess:
    """One ``backfill worker --node NODE --engine-url URL`` process."""

    def __init__(
        self,
        node: str,
        engine_url: str,
        env: Mapping[str, str],
        log: Path,
        *,
        beat: bool = False,
    ) -> None:
        self.node = node
        self.engine_url = engine_url
        self.env = dict(env)
        self.log = log
        self.beat = beat
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_start = 0

    def start(self) -> None:
        self._log_start = self.log.stat().st_size if self.log.exists() else 0
        argv = [
            sys.executable, "-m", "backfill_cli", "worker", "--node", self.node,
            "--engine-url", self.engine_url,
        ]  # fmt: skip
        if self.beat:
            argv.append("--beat")
        # A fresh folder per process: Celery's beat schedule file and nothing else lands here.
        self.proc = _spawn(argv, self.log, self.env, cwd=Path(tempfile.gettempdir()))

    def log_text(self) -> str:
        try:
            with self.log.open("rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 120) -> float:
        """Wait until the dispatcher runs (its start line is in the log)."""

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"worker exited early:\n{self.log_text()[-3000:]}")
            log = self.log_text()
            if "stopped on an error" in log:
                raise AssertionError(f"the worker's dispatcher died:\n{log[-3000:]}")
            return f"node {self.node}: engine" in log

        return wait_until(ready, timeout, f"worker for {self.node} to start", poll=0.1)

    def is_ready(self) -> bool:
        return self.alive() and f"node {self.node}: engine" in self.log_text()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            harness.signal_group(self.proc, sig)

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs."""
        if self.proc is not None:
            harness.signal_group(self.proc)
            self.proc.wait(10)

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM (Celery's warm shutdown) and wait; returns the exit code."""
        assert self.proc is not None
        harness.signal_group(self.proc, signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def stats(self) -> dict[str, int]:
        """The dispatcher's counters as its shutdown line printed them (empty if none)."""
        found = _STATS.search(self.log_text())
        if found is None:
            return {}
        out: dict[str, int] = {}
        for part in found.group("fields").split(","):
            key, _, value = part.strip().partition("=")
            if value.isdigit():
                out[key] = int(value)
        return out

    def close(self) -> None:
        if self.alive():
            self.signal(signal.SIGCONT)
            self.kill()


def worker_env(
    database_url: str, redis_url: str, namespace: str, **extra: object
) -> dict[str, str]:
    """The environment of a ``backfill worker`` for one test deployment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BACKFILL_")}
    env.update(
        BACKFILL_DATABASE_URL=database_url,
        BACKFILL_REDIS_URL=redis_url,
        BACKFILL_REDIS_NAMESPACE=namespace,
        BACKFILL_LOG_LEVEL="INFO",
    )
    for key, value in extra.items():
        env[f"BACKFILL_{key.upper()}"] = str(value)
    return env
