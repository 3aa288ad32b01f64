"""The API process's own ingest processes: started when the first create is deferred (or at
start-up if deferred creates already wait), woken by each deferred create, stopped with the
API. The loop they run is ``backfill.ingester``; a deployment may run ``backfill ingest``
beside instead (``BACKFILL_INGESTERS=0``)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
from multiprocessing.process import BaseProcess

from backfill import ingester
from backfill.config import Settings

log = logging.getLogger("backfill.api")

STOP_WAIT_S = 10.0
"""How long a stopping API waits for an ingest to give up before it kills the process (an
ingest stopped half way stores nothing; its job is taken again)."""


class IngestProcesses:
    """``count`` ingest processes of this API process, started at most once."""

    def __init__(self, settings: Settings, count: int) -> None:
        self._settings = settings
        self._count = count
        # spawn: a fresh interpreter, none of the API's threads or sockets forked into it.
        self._context = multiprocessing.get_context("spawn")
        self._stop = self._context.Event()
        self._wake = self._context.Event()
        self._ready = self._context.Event()
        self._processes: list[BaseProcess] = []
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        return sum(1 for p in self._processes if p.is_alive())

    @property
    def ready(self) -> bool:
        """Whether an ingest process has started and looks at the queue (or none is to
        run)."""
        return self._count == 0 or (self._ready.is_set() and self.running > 0)

    def ensure_started(self) -> None:
        """Start the processes if they are not running (again, if one died)."""
        if self._count == 0 or self._stop.is_set():
            return
        with self._lock:
            self._processes = [p for p in self._processes if p.is_alive()]
            while len(self._processes) < self._count:
                process = self._context.Process(
                    target=ingester.serve,
                    args=(self._settings, self._stop, self._wake),
                    kwargs={"parent_pid": os.getpid(), "ready": self._ready},
                    name="backfill-ingest",
                    daemon=True,
                )
                process.start()
                self._processes.append(process)
                log.info("ingest process %s started", process.pid)

    def wake(self) -> None:
        """A create was deferred: start the processes if need be, and wake an idle one."""
        self.ensure_started()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        with self._lock:
            for process in self._processes:
                process.join(STOP_WAIT_S)
                if process.is_alive():
                    process.kill()
                    process.join()
            self._processes = []
