"""The engine as the throughput benchmark runs and reads it: the flags and environment the
peer gets so it runs the same engine as Backfill's, CPU seconds per process tree from /proc,
prefix-cache hits and the engine's running/waiting load sampled in a thread.
"""

from __future__ import annotations

import os
import statistics
import threading
from pathlib import Path

import httpx

from backfill.engine_metrics import parse_engine_load
from devkit import devengine

MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's CPU defaults, passed explicitly so the server and run-batch surely agree."""


def engine_args(spec: devengine.ModelSpec) -> list[str]:
    return [
        "--max-model-len", str(spec.max_model_len),
        # The dtype the dev engine serves this model in here (float32 where the CPU would
        # emulate bfloat16), so the peer runs the same model as Backfill's engine.
        "--dtype", devengine.choose_dtype(spec.dtype, devengine.cpu_flags()).dtype,
        "--scheduling-policy", "priority",
        "--enforce-eager",
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
    ]  # fmt: skip


def engine_env(workdir: Path, kv_cache_gib: int) -> dict[str, str]:
    """The environment ``devengine.start_engine`` gives the server, for run-batch."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("VIRTUAL_ENV", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get(
            "VLLM_CPU_OMP_THREADS_BIND", devengine.omp_threads_bind()
        ),
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        HF_HOME=str(workdir / "hf"),
        VLLM_NO_USAGE_STATS="1",
        VLLM_DO_NOT_TRACK="1",
    )
    return env


def process_ticks() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgid, user + system clock ticks) for every process now."""
    found: dict[int, tuple[int, int, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            # After the name: state, ppid, pgrp, ... utime (14th field), stime (15th).
            found[int(stat.parent.name)] = (
                int(fields[1]),
                int(fields[2]),
                int(fields[11]) + int(fields[12]),
            )
        except (OSError, IndexError, ValueError):
            continue
    return found


def cpu_seconds(server_pid: int, trees: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by the vLLM server's API process, by the rest of its process
    group (engine core and model worker), and by each named process with its descendants.

    A steadier measure of a side's overhead than wall time on a machine whose two cores
    other people's engines and tests also use.
    """
    ticks = process_ticks()
    hz = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in ticks.items():
        children.setdefault(ppid, []).append(pid)

    def tree(pid: int) -> int:
        return ticks.get(pid, (0, 0, 0))[2] + sum(tree(c) for c in children.get(pid, ()))

    out = {
        "vllm_api": ticks.get(server_pid, (0, 0, 0))[2] / hz,
        "engine": sum(t for p, (_, g, t) in ticks.items() if g == server_pid and p != server_pid)
        / hz,
    }
    out.update({name: tree(pid) / hz for name, pid in trees.items()})
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {f"cpu_s_{k}": round(after[k] - before.get(k, 0.0), 2) for k in after}


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


class LoadSampler:
    """Samples the engine's running and waiting requests every ``interval_s`` in a thread:
    how full each side keeps the engine is the first thing to look at when one is slower."""

    def __init__(self, url: str, interval_s: float = 0.5) -> None:
        self.url = url
        self.interval_s = interval_s
        self.running: list[float] = []
        self.waiting: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.interval_s):
                try:
                    load = parse_engine_load(client.get(f"{self.url}/metrics").text)
                except (httpx.HTTPError, ValueError):
                    continue
                self.running.append(load.num_requests_running)
                self.waiting.append(load.num_requests_waiting)

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict[str, float]:
        if not self.running:
            return {}
        return {
            "engine_running_mean": statistics.fmean(self.running),
            "engine_waiting_mean": statistics.fmean(self.waiting),
        }
