"""The ingest loop: take a deferred create, check its file and store its items, and again
until none waits; then sleep until woken or a poll interval passes.

Two ingests overlap: the next one is taken and reads its file (Python's work, in this process)
while the one before it COPYs its items (Postgres' work, in its backend), so checking every
line before the COPY costs a queue of good files no throughput. Never more than one reads at a
time, and never more than two run; each judges the tenant's stored items, its quota and the
deadline only once the one before it has ended, and so commits after it
(``backfill.batch_ingest.Overlap``).

Small files (``ingest_express_bytes``) go by an express lane beside it, one at a time: with the
main loop alone, a tenant's create of a few lines, taken as the second of the overlap, waited
for another tenant's large COPY to end. The main loop then takes only larger files. One
tenant's creates are judged and stored in turn across both lanes (:class:`TenantTurns`), so two
of its files read side by side still cannot pass its storage cap or quota together.

It runs in a process of its own (the API starts one, ``backfill ingest`` runs one beside),
at a lower CPU priority than the API's: a large file's per-line work never holds the API's
interpreter, and a key lookup or a status read never waits behind it. The queue, the hold on
a job and the count of its ingests are the store's (``backfill.store.ingest_queue``); what an
ingest does is ``backfill.batch_ingest``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

from backfill.batch_ingest import Overlap, ingest_deferred
from backfill.config import Settings
from backfill.states import JobState
from backfill.store import IngestStore
from backfill.store.ingest_queue import ANY_SIZE

log = logging.getLogger("backfill.ingest")

IDLE_POLL_S = 1.0
"""How long an idle ingest loop sleeps before it looks at the queue again (a create in this
API process wakes it at once; one made through another API process waits at most this)."""

ERROR_PAUSE_S = 2.0

BELL_POLL_S = 0.25
"""How often the doorbell's reader looks whether the loop is to stop."""


class Stop(Protocol):
    """Says when the loop is to end (``threading.Event``)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = ...) -> bool: ...


class Wake(Protocol):
    """Cuts an idle loop's sleep short: set by whoever queues a create."""

    def wait(self, timeout: float | None = ...) -> bool: ...

    def clear(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Ingested:
    job_id: str
    attempt: int
    state: JobState | None
    """The job's state after (None: it is gone)."""
    seconds: float


def ingest_next(
    repo: IngestStore,
    settings: Settings,
    overlap: Overlap | None = None,
    *,
    sizes: tuple[int, int] = ANY_SIZE,
) -> Ingested | None:
    """One deferred create (of a file whose size is in ``sizes``: above the first, at most
    the second) checked and stored (or failed), held against every other ingest while it
    runs; None when none waits."""
    with repo.ingest_queue.take_deferred_ingest(sizes=sizes) as take:
        if take is None:
            return None
        started = time.monotonic()
        job = ingest_deferred(repo, settings, take.job_id, take.attempt, overlap=overlap)
        return Ingested(
            take.job_id,
            take.attempt,
            job.state if job is not None else None,
            time.monotonic() - started,
        )


RUNNING = object()
"""A handoff's outcome while its ingest still runs."""

FAILED = object()
"""The outcome of an ingest that raised (it has logged why)."""


class TenantTurns:
    """One tenant's creates judged and stored one at a time in this process, whichever lane
    takes them: two files of a tenant read side by side cannot pass its storage cap or its
    quota together (each judges what the other stored)."""

    def __init__(self) -> None:
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def of(self, tenant_id: str) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault(tenant_id, threading.Lock())


class Handoff:
    """One ingest's place in the overlap (an :class:`Overlap`): it tells the loop when its
    file is read, and waits for the ingest taken before it and for its tenant's turn.
    ``outcome`` is the ingest's result if it ended before its file counted as read (None: no
    create waited), else :data:`RUNNING`."""

    def __init__(self, earlier: Future[None] | None, turns: TenantTurns) -> None:
        self._earlier = earlier
        self._turns = turns
        self._turn: threading.Lock | None = None
        self.read = threading.Event()
        self.outcome: object = RUNNING

    def file_read(self) -> None:
        self.read.set()

    def wait_for_earlier(self, tenant_id: str) -> None:
        if self._earlier is not None:
            wait_for([self._earlier])
        self._turn = self._turns.of(tenant_id)
        self._turn.acquire()

    def ended(self, outcome: object) -> None:
        if self._turn is not None:
            self._turn.release()
            self._turn = None
        if not self.read.is_set():
            self.outcome = outcome
        self.read.set()


def _logged(done: Ingested | None) -> Ingested | None:
    if done is not None:
        log.info(
            "ingest: batch %s %s in %.1f s (ingest %d)",
            done.job_id,
            done.state.value if done.state is not None else "gone",
            done.seconds,
            done.attempt,
        )
    return done


def lanes(settings: Settings) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """The sizes of file the main loop takes and those the express lane takes (None: no
    express lane): with one, the main loop leaves it every small file, which otherwise it
    might take as the second of its overlap, to wait for a large file's COPY."""
    small = settings.ingest_express_bytes
    if small <= 0:
        return ANY_SIZE, None
    return (small, ANY_SIZE[1]), (ANY_SIZE[0], small)


def _ingest_one(
    repo: IngestStore, settings: Settings, handoff: Handoff, sizes: tuple[int, int]
) -> None:
    """``ingest_next`` in an ingest thread, logged; its file counts as read however it ends."""
    outcome: object = FAILED
    try:
        outcome = _logged(ingest_next(repo, settings, handoff, sizes=sizes))
    except Exception:
        log.exception("ingest: a deferred create could not be ingested; trying again")
    finally:
        handoff.ended(outcome)


class Bells:
    """One doorbell rung for both lanes: a thread reads ``wake`` and sets an event for each,
    and sets both once ``stop`` is (without a doorbell the lanes poll)."""

    def __init__(self, wake: Wake | None, stop: Stop) -> None:
        self.main = threading.Event()
        self.express = threading.Event()
        self._wake = wake
        self._stop = stop
        threading.Thread(target=self._listen, name="ingest-bells", daemon=True).start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            rung = (
                self._wake.wait(BELL_POLL_S)
                if self._wake is not None
                else self._stop.wait(BELL_POLL_S)
            )
            if rung and self._wake is not None:
                self._wake.clear()
                self._ring()
        self._ring()

    def _ring(self) -> None:
        self.main.set()
        self.express.set()


def express_lane(
    repo: IngestStore,
    settings: Settings,
    stop: Stop,
    bell: threading.Event,
    turns: TenantTurns,
    idle_poll_s: float,
    sizes: tuple[int, int],
) -> None:
    """Small deferred creates (files of at most ``ingest_express_bytes``), one at a time apart
    from the main loop: a create of a few lines is stored in moments while the main loop
    COPYs another tenant's large file (with one lane, it waited for that COPY to end). It
    waits only for its own tenant's turn."""
    while not stop.is_set():
        bell.clear()  # a ring from here on is seen by the next look
        turn = Handoff(None, turns)
        try:
            done = _logged(ingest_next(repo, settings, turn, sizes=sizes))
        except Exception:
            log.exception("ingest: a small deferred create could not be ingested; trying again")
            stop.wait(ERROR_PAUSE_S)
            continue
        finally:
            turn.ended(None)
        if done is None:
            bell.wait(idle_poll_s)


def run(
    repo: IngestStore,
    settings: Settings,
    stop: Stop,
    wake: Wake | None = None,
    *,
    idle_poll_s: float = IDLE_POLL_S,
) -> None:
    """Ingest until ``stop`` is set, two ingests overlapping (see the module's docstring),
    and small creates in an express lane beside them. ``wake`` (set by whoever queues a
    create) cuts an idle sleep short. An ingest stopped half way stores nothing; its job is
    taken again. The ingests in flight end before this returns."""
    bells = Bells(wake, stop)
    turns = TenantTurns()
    main_sizes, express_sizes = lanes(settings)
    express = threading.Thread(
        target=express_lane,
        args=(repo, settings, stop, bells.express, turns, idle_poll_s, express_sizes),
        name="ingest-express",
    )
    if express_sizes is not None:
        express.start()
    with ThreadPoolExecutor(2, thread_name_prefix="ingest") as ingests:
        earlier: Future[None] | None = None
        while not stop.is_set():
            bells.main.clear()
            handoff = Handoff(earlier, turns)
            earlier = ingests.submit(_ingest_one, repo, settings, handoff, main_sizes)
            # The next is taken once this one has read its file; its COPY runs meanwhile.
            handoff.read.wait()
            outcome = handoff.outcome
            if outcome is FAILED:
                stop.wait(ERROR_PAUSE_S)
            elif outcome is None:
                bells.main.wait(idle_poll_s)
    if express.is_alive():
        express.join()


LOWER_PRIORITY = 19
"""How much an ingest process lowers its CPU priority (``nice``): the API it sits beside
answers first."""


class Doorbell:
    """The ingest process's end of a pipe its API process writes a byte into for each create
    it defers (a :class:`Wake`; no lock or semaphore shared between the processes)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        os.set_blocking(conn.fileno(), False)

    def wait(self, timeout: float | None = None) -> bool:
        return self._conn.poll(timeout)

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._conn.fileno(), 4096):
                pass


class ParentGone:
    """``stop``, or set once the process that started this one is gone (an API process killed
    outright never stops its ingest processes itself)."""

    def __init__(self, stop: Stop, parent_pid: int) -> None:
        self._stop = stop
        self._parent_pid = parent_pid

    def is_set(self) -> bool:
        return self._stop.is_set() or os.getppid() != self._parent_pid

    def wait(self, timeout: float | None = None) -> bool:
        self._stop.wait(timeout)
        return self.is_set()


def serve(
    settings: Settings,
    *,
    doorbell: Connection | None = None,
    ready: Connection | None = None,
    parent_pid: int | None = None,
) -> None:
    """An ingest process's body, until SIGTERM or SIGINT: its own small pool, the lowest CPU
    priority, the loop. ``doorbell``: the pipe its API process rings for each deferred
    create; ``ready``: a pipe it says ``ready`` on once it looks at the queue;
    ``parent_pid``: it ends when that process is gone too."""
    from backfill import logs  # noqa: PLC0415 - a fresh process configures its own logging
    from backfill.store import Repository  # noqa: PLC0415 - the pool opens in the process

    logs.configure(settings.log_level, settings.log_format, root=True)
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    stop: Stop = stopping if parent_pid is None else ParentGone(stopping, parent_pid)
    with contextlib.suppress(OSError):
        os.nice(LOWER_PRIORITY)
    # Two ingests at once, each a connection holding its job and one for its transaction, and
    # a third while it judges the tenant's figures; the express lane's two beside.
    repo = Repository.connect(settings.database_url, pool_size=5)
    if ready is not None:
        ready.send_bytes(b"ready")
    try:
        run(repo, settings, stop, Doorbell(doorbell) if doorbell is not None else None)
    finally:
        repo.close()
