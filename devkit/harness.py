"""The one process harness of the dev tooling, the benchmarks and the tests: a free port, a
child started with its output in a log (in a session of its own, killed by the kernel if its
starter dies first), a wait until it answers, and a stop (a signal, a grace period, then
SIGKILL, to its whole process group when it leads one).

Callers keep their own error types: :func:`wait_ready` raises :class:`ExitedWhileStarting` or
:class:`NotReady`, and each caller says in its own words what did not start.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal

_PR_SET_PDEATHSIG = 1


class HarnessError(Exception):
    """A child process did not come up."""


class ExitedWhileStarting(HarnessError):
    """The child exited before it answered."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"exited with code {returncode} while starting")
        self.returncode = returncode


class NotReady(HarnessError):
    """The child is running but did not answer in time."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"did not answer within {timeout_s:.0f} s")
        self.timeout_s = timeout_s


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""The ports the kernel gives the local end of outgoing connections."""

BELOW_EPHEMERAL = 6_000
"""How many ports under the ephemeral range :func:`free_port` picks from (26768-32767 with
Linux's default range: clear of the local Redis Cluster's nodes and bus ports,
``devkit.redis_cluster``)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now, below the kernel's ephemeral range.

    The child binds it a moment later, and an engine's scheduler metrics only after its model
    has loaded (tens of seconds). Meanwhile a port of the ephemeral range may become the local
    end of any outgoing connection on the machine, and the bind then fails: the hunt's run 16
    lost an engine's metrics port so (``Address already in use``). Below the range only
    another listener can take it, and the bind here checks that none has."""
    low = _ephemeral_low()
    if low - BELOW_EPHEMERAL >= 1024:
        for _ in range(100):
            port = random.randrange(low - BELOW_EPHEMERAL, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    """The lowest port of the ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` that asks Linux to send ``sig`` to the child when the process that
    started it dies, so a killed run leaves no server behind."""

    def arm() -> None:
        # Runs in the child between fork and exec; where prctl is missing there is no guard.
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig)

    return arm


def spawn(
    argv: Sequence[str | Path],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    log_mode: Literal["ab", "wb"] = "ab",
    own_session: bool = True,
    death_signal: int | None = signal.SIGTERM,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with stdin closed and stdout and stderr into ``log``; with
    ``own_session`` it leads a process group of its own (stopped as a whole by :func:`stop`),
    and with ``death_signal`` the kernel sends it that signal if this process dies first."""
    with log.open(log_mode) as out:
        return subprocess.Popen(  # noqa: S603 - argv from the caller's fixed parts and paths
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=own_session,
            preexec_fn=die_with_parent(death_signal) if death_signal is not None else None,  # noqa: PLW1509 - no threads touch the child
        )


def wait_ready(
    watch: subprocess.Popen[bytes] | Sequence[subprocess.Popen[bytes]],
    answers: Callable[[], bool],
    timeout_s: float,
    *,
    poll_s: float = 0.3,
) -> float:
    """Poll ``answers`` until it is true; returns the seconds it took. Raises
    :class:`ExitedWhileStarting` as soon as a watched child exits, :class:`NotReady` after
    ``timeout_s``."""
    procs = [watch] if isinstance(watch, subprocess.Popen) else list(watch)
    start = time.monotonic()
    end = start + timeout_s
    while True:
        for proc in procs:
            code = proc.poll()
            if code is not None:
                raise ExitedWhileStarting(code)
        if answers():
            return time.monotonic() - start
        if time.monotonic() > end:
            raise NotReady(timeout_s)
        time.sleep(poll_s)


def signal_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``proc`` leads (none left: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop(
    proc: subprocess.Popen[bytes],
    grace_s: float,
    *,
    sig: int = signal.SIGTERM,
    group: bool = False,
    sig_to: Literal["group", "leader"] = "group",
    kill_wait_s: float | None = None,
    on_overrun: Callable[[], None] | None = None,
) -> None:
    """Send ``sig``, wait ``grace_s``, then SIGKILL and wait ``kill_wait_s`` (None: as long as
    it takes). With ``group`` (the child leads a group of its own, as :func:`spawn` starts it)
    the SIGKILL goes to the whole group, and what is left of the group once the child is gone
    (its own children may outlive it) is killed too; ``sig`` goes to the group unless
    ``sig_to`` is ``"leader"`` (a server that shuts its children down itself)."""
    if proc.poll() is None:
        if group and sig_to == "group":
            signal_group(proc, sig)
        else:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            if on_overrun is not None:
                on_overrun()
            if group:
                signal_group(proc)
            else:
                proc.kill()
            proc.wait(kill_wait_s)
    if group:
        signal_group(proc)
