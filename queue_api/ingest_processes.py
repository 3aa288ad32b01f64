"""The API process's own ingest processes: started with ``backfill api`` (an in-process app:
at its first deferred create, or at start-up if deferred creates already wait), rung for each
deferred create, stopped with the API. The loop they run is ``backfill.ingester``; a
deployment may run ``backfill ingest`` beside instead (``BACKFILL_INGESTERS=0``).

Nothing but pipes is shared with them (no lock or semaphore to leak): a doorbell pipe the API
writes a byte into, non-blocking, for each deferred create, and a pipe each says ``ready`` on;
they are stopped with SIGTERM, and end by themselves if the API process is gone.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from backfill import ingester
from backfill.config import Settings

log = logging.getLogger("backfill.api")

STOP_WAIT_S = 10.0
"""How long a stopping API waits for an ingest to give up before it kills the process (an
ingest stopped half way stores nothing; its job is taken again)."""


@dataclass
class _Child:
    process: BaseProcess
    doorbell: Connection
    ready: Connection
    is_ready: bool = False


class IngestProcesses:
    """``count`` ingest processes of this API process."""

    def __init__(self, settings: Settings, count: int) -> None:
        self._settings = settings
        self._count = count
        # spawn: a fresh interpreter, none of the API's threads or sockets forked into it.
        self._context = multiprocessing.get_context("spawn")
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def running(self) -> int:
        return sum(1 for c in self._children if c.process.is_alive())

    @property
    def ready(self) -> bool:
        """Whether an ingest process looks at the queue (or none is to run)."""
        if self._count == 0:
            return True
        with self._lock:
            for child in self._children:
                if not child.is_ready and child.ready.poll(0):
                    child.is_ready = True
            return any(c.is_ready and c.process.is_alive() for c in self._children)

    def ensure_started(self) -> None:
        """Start the processes if they are not running (again, if one died)."""
        if self._count == 0 or self._stopped:
            return
        with self._lock:
            for child in [c for c in self._children if not c.process.is_alive()]:
                self._close(child)
                self._children.remove(child)
            while len(self._children) < self._count:
                self._children.append(self._start())

    def _start(self) -> _Child:
        bell_out, bell_in = self._context.Pipe(duplex=False)
        ready_out, ready_in = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=ingester.serve,
            args=(self._settings,),
            kwargs={"doorbell": bell_out, "ready": ready_in, "parent_pid": os.getpid()},
            name="backfill-ingest",
            daemon=True,
        )
        process.start()
        # The child holds its own ends now.
        bell_out.close()
        ready_in.close()
        os.set_blocking(bell_in.fileno(), False)
        log.info("ingest process %s started", process.pid)
        return _Child(process, bell_in, ready_out)

    def wake(self) -> None:
        """A create was deferred: start the processes if need be, and ring each."""
        self.ensure_started()
        with self._lock:
            for child in self._children:
                # A full pipe already says there is work: never block the API on it.
                with contextlib.suppress(BlockingIOError, BrokenPipeError):
                    os.write(child.doorbell.fileno(), b"!")

    def stop(self) -> None:
        self._stopped = True
        with self._lock:
            for child in self._children:
                child.process.terminate()
            for child in self._children:
                child.process.join(STOP_WAIT_S)
                if child.process.is_alive():
                    child.process.kill()
                    child.process.join()
                self._close(child)
            self._children = []

    @staticmethod
    def _close(child: _Child) -> None:
        child.doorbell.close()
        child.ready.close()
