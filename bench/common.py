"""What every benchmark shares: arguments, tables, the JSON record and the closing line.

Each benchmark ends with exactly one line ``NAME: <figure>=<value> (goal <op> <target>) ok|short``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psycopg

from backfill.config import get_settings, libpq_url
from devkit import harness
from migrations.migrate import upgrade

OUT_DIR = Path(__file__).parent / "out"

_OPS = {
    ">=": lambda v, t: v >= t,
    "<=": lambda v, t: v <= t,
    ">": lambda v, t: v > t,
    "<": lambda v, t: v < t,
}


T = TypeVar("T")


def parser(name: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description)
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    return p


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return float(statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1])


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    sep = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join([line, sep, *body])


def finish(
    name: str,
    figure: str,
    value: float,
    op: str,
    target: float,
    details: dict[str, Any],
    *,
    reason: str | None = None,
    holds: bool = True,
) -> bool:
    """Write ``bench/out/NAME.json`` and print the closing line; returns whether the goal held.
    With ``reason`` the run gives no verdict: the line says ``short`` and why. ``holds`` False
    marks it short whatever the figure (a condition of the goal failed)."""
    ok = reason is None and holds and bool(_OPS[op](value, target))
    record = {
        "name": name,
        "figure": figure,
        "value": value,
        "goal": f"{op} {target}",
        "ok": ok,
        "reason": reason,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "details": details,
    }
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"{name}.json").write_text(json.dumps(record, indent=2, default=str))
    shown = f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    if shown == f"{target:.3g}" and value != target:
        shown = f"{value:.6g}"  # 1.005 against a goal of 1.0 must not read "1 ... short"
    said = "ok" if ok else "short" + (f" ({reason})" if reason else "")
    print(f"{name}: {figure}={shown} (goal {op} {target}) {said}")
    return ok


def beside_load(
    loads: Sequence[Callable[[threading.Event], None]],
    measure: Callable[[], T],
    settle_s: float = 1.0,
    join_s: float = 180.0,
) -> T:
    """``measure()`` while each of ``loads`` runs in a thread of its own (each is given an
    event that says when to stop), ``settle_s`` after they started; they are stopped and
    joined after."""
    stop = threading.Event()
    threads = [threading.Thread(target=load, args=(stop,), daemon=True) for load in loads]
    for t in threads:
        t.start()
    try:
        time.sleep(settle_s)
        return measure()
    finally:
        stop.set()
        for t in threads:
            t.join(join_s)


def answers(url: str) -> bool:
    """Whether ``url`` answers 200 now."""
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def served(
    name: str,
    argv: Sequence[str | Path],
    ready_url: str,
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """A server a benchmark starts (``argv``, output in ``log``) for the block, once
    ``ready_url`` answers; stopped (its process group) after. Fails naming ``name`` and the
    log's tail when it exits or does not answer in ``timeout_s``."""
    proc = harness.spawn(argv, log, env=env, log_mode="wb")
    try:
        try:
            harness.wait_ready(proc, partial(answers, ready_url), timeout_s, poll_s=0.1)
        except harness.HarnessError as exc:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{name} {exc}: {tail}") from None
        yield proc
    finally:
        harness.stop(proc, 15, group=True)


class Stopwatch:
    """``with Stopwatch() as sw: ...; sw.seconds``"""

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0


@contextmanager
def scratch_database(prefix: str = "bfbench") -> Iterator[str]:
    """A fresh database at migration head on the configured server, dropped afterwards.

    Yields its SQLAlchemy URL. Benchmarks never touch the database a deployment uses.
    """
    admin_url = get_settings().database_url
    base = admin_url.rpartition("/")[0]
    name = f"{prefix}_{secrets.token_hex(4)}"
    with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{base}/{name}"
    try:
        upgrade(url)
        yield url
    finally:
        with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
