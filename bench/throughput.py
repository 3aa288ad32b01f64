"""Batch throughput: Backfill end to end vs ``vllm run-batch`` vs a direct asyncio client.

The same summarisation requests (chat, temperature 0, ``ignore_eos`` with a fixed
``max_tokens``, so every side generates exactly the same number of tokens) go through:

* **Backfill** — the real ``backfill api`` and ``backfill worker --beat`` processes against a
  vLLM server: upload the JSONL, then time ``POST /v1/batches`` until the batch is
  ``completed`` (output file written). Items done (all results durable) is reported too.
* **vllm run-batch** — vLLM's own batch runner, in-process engine, same engine flags; timed
  from the runner's own ``run_batch`` coroutine (read input, run every request, write output),
  so the engine's start is excluded. The whole process's wall time is reported beside it.
* **direct** — an ``httpx`` asyncio client posting non-streaming requests to the same vLLM
  server as Backfill, at the best concurrency of a short sweep.

Two models: ``smollm2`` (real 135M model; the engine is the bottleneck; goal >= 0.9x the best
peer) and ``tiny`` (random 459k-parameter model; queue overhead shows; goal >= 0.75x). Every
side and every round gets its own random prefix on every prompt, so vLLM's prefix cache never
helps anyone (the server's ``vllm:prefix_cache_hits_total`` is read to check). Sides alternate
order from round to round; figures are best-of with the spread (min-max) beside them, because
other engineers' engines and tests share these 2 cores.

A full run uses 2,000 ``tiny`` requests (two rounds) and 240 ``smollm2`` requests (one round,
the peers' note's size): the real model makes ~125 tokens/s here on a quiet machine, so 2,000
of its requests would take ~17 minutes per side (``--requests`` overrides).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from backfill.capacity import parse_engine_load
from backfill.store import Repository
from bench.common import OUT_DIR, finish, machine, parser, scratch_database, table
from worker import devengine
from worker.dev import DOCS, PROMPT

NAME = "throughput"
GOAL = 0.9
TINY_GOAL = 0.75
PLOT = Path(__file__).parent / "throughput.png"
BACKFILL = [sys.executable, "-m", "backfill_cli"]
MAX_NUM_SEQS = 128
MAX_NUM_BATCHED_TOKENS = 2048
"""vLLM's CPU defaults, passed explicitly so the server and run-batch surely agree."""
SIDES = ("backfill", "run-batch", "direct")
_NOT_SIDE_CPU = {"cpu_s_process_with_start"}

# Runs vLLM's batch runner exactly as ``python -m vllm.entrypoints.openai.run_batch`` does,
# with a timer around its processing coroutine: its log timestamps have one-second resolution,
# too coarse for a 10-second run, and the engine's start must be left out.
RUN_BATCH_DRIVER = """
import asyncio, json, os, time
from pathlib import Path
import vllm.entrypoints.launchers.run_batch as rb
def tree_cpu():
    kids, ticks = {}, {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            f = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        kids.setdefault(int(f[1]), []).append(pid)
        ticks[pid] = int(f[11]) + int(f[12])
    todo, total = [os.getpid()], 0
    while todo:
        pid = todo.pop()
        total += ticks.get(pid, 0)
        todo += kids.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")
inner = rb.run_batch
async def timed(engine_client, args):
    t0, c0 = time.perf_counter(), tree_cpu()
    await inner(engine_client, args)
    out = {"seconds": time.perf_counter() - t0, "cpu_s": tree_cpu() - c0}
    print("BACKFILL_RUN_BATCH " + json.dumps(out), flush=True)
rb.run_batch = timed
asyncio.run(rb.main(rb.parse_args()))
"""


@dataclass(frozen=True)
class Workload:
    model: str
    requests: int
    prompt_chars: int
    max_tokens: int
    rounds: int
    sweep: tuple[int, ...]
    sweep_requests: int
    kv_cache_gib: int
    goal: float


def workloads(quick: bool) -> list[Workload]:
    # KV space: 2 GiB gives smollm2 ~93k tokens, so Backfill's batch slack (75% after the
    # interactive reserve) still holds max_num_seqs of its ~600-token reservations.
    if quick:
        return [
            Workload("tiny", 300, 60, 32, 1, (32, 128, 256), 300, 1, TINY_GOAL),
            Workload("smollm2", 48, 1700, 64, 1, (32, 64), 32, 2, GOAL),
        ]
    return [
        Workload("tiny", 2000, 60, 32, 2, (32, 128, 256), 500, 1, TINY_GOAL),
        Workload("smollm2", 240, 1700, 64, 1, (32, 64), 64, 2, GOAL),
    ]


@dataclass
class SideRun:
    side: str
    model: str
    round: int
    requests: int
    seconds: float
    output_tokens: int
    prompt_tokens: int
    concurrency: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        """Output tokens per CPU second of the side's own processes (engine, vLLM API server,
        Backfill's API and worker or the client; Postgres and Redis not counted): how much
        work each token costs, which other people's load on the cores does not change."""
        cpu = sum(
            v for k, v in self.extra.items() if k.startswith("cpu_s_") and k not in _NOT_SIDE_CPU
        )
        return self.output_tokens / cpu if cpu > 0 else 0.0


# ---------------------------------------------------------------------------------------------
# The workload


def _corpus() -> str:
    return "\n\n".join(p.read_text().strip() for p in sorted(DOCS.glob("*.txt")))


def request_lines(w: Workload, served: str, n: int, tag: str) -> list[dict[str, Any]]:
    """``n`` OpenAI batch lines; each prompt starts with ``tag`` and its index (unique)."""
    corpus = _corpus()
    span = max(1, len(corpus) - w.prompt_chars)
    lines = []
    for i in range(n):
        start = (i * 7919) % span
        text = corpus[start : start + w.prompt_chars]
        body = {
            "model": served,
            "max_tokens": w.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "messages": [
                {"role": "user", "content": f"[{tag}-{i:05d}] " + PROMPT.format(text=text)}
            ],
        }
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return lines


def _jsonl(lines: Sequence[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _usage_totals(bodies: Sequence[dict[str, Any]]) -> tuple[int, int]:
    out = sum(int(b["usage"]["completion_tokens"]) for b in bodies)
    prompt = sum(int(b["usage"]["prompt_tokens"]) for b in bodies)
    return out, prompt


# ---------------------------------------------------------------------------------------------
# The engine and what it reports


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


def _cpu_ticks() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, pgid, user + system clock ticks) for every process now."""
    found: dict[int, tuple[int, int, int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
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
    ticks = _cpu_ticks()
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


# ---------------------------------------------------------------------------------------------
# Side (c): a direct asyncio client


async def _direct(
    url: str, lines: Sequence[dict[str, Any]], concurrency: int
) -> tuple[list[Any], int]:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    queue = iter(lines)
    bodies: list[dict[str, Any]] = []
    retries: list[int] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        for line in queue:
            for attempt in range(3):
                try:
                    response = await client.post(line["url"], json=line["body"])
                    break
                except httpx.TransportError:
                    # A pooled connection the server closed as it was reused (seen under
                    # heavy load); a real client retries, and the count is reported.
                    retries.append(1)
                    if attempt == 2:
                        raise
            response.raise_for_status()
            bodies.append(response.json())

    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(1800), limits=limits
    ) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return bodies, len(retries)


def run_direct(
    server: devengine.EngineServer,
    w: Workload,
    served: str,
    n: int,
    concurrency: int,
    round_no: int,
) -> SideRun:
    url = server.url
    lines = request_lines(w, served, n, secrets.token_hex(4))
    hits = prefix_cache_hits(url)
    cpu0 = cpu_seconds(server.pid, {})
    with LoadSampler(url) as sampler:
        t0 = time.perf_counter()
        client0 = time.process_time()
        bodies, retries = asyncio.run(_direct(url, lines, concurrency))
        client_cpu = time.process_time() - client0
        seconds = time.perf_counter() - t0
    cpu = cpu_delta(cpu0, cpu_seconds(server.pid, {}))
    out, prompt = _usage_totals(bodies)
    return SideRun(
        "direct",
        w.model,
        round_no,
        n,
        seconds,
        out,
        prompt,
        concurrency,
        {
            "prefix_cache_hits": prefix_cache_hits(url) - hits,
            "retries": retries,
            **sampler.summary(),
            **cpu,
            "cpu_s_client": round(client_cpu, 2),
        },
    )


# ---------------------------------------------------------------------------------------------
# Side (b): vllm run-batch


def run_vllm_batch(
    python: Path, model_dir: Path, w: Workload, round_no: int, workdir: Path
) -> SideRun:
    spec = devengine.MODELS[w.model]
    lines = request_lines(w, spec.name, w.requests, secrets.token_hex(4))
    src, dst = workdir / "in.jsonl", workdir / "out.jsonl"
    src.write_bytes(_jsonl(lines))
    dst.unlink(missing_ok=True)
    argv = [
        str(python), "-c", RUN_BATCH_DRIVER,
        "-i", str(src), "-o", str(dst),
        "--model", str(model_dir), "--served-model-name", spec.name,
        *engine_args(spec),
    ]  # fmt: skip
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        argv,
        cwd=workdir,
        env=engine_env(workdir, w.kv_cache_gib),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    total = time.perf_counter() - t0
    children1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_total = (children1.ru_utime - children0.ru_utime) + (
        children1.ru_stime - children0.ru_stime
    )
    marker = [ln for ln in proc.stdout.splitlines() if ln.startswith("BACKFILL_RUN_BATCH ")]
    if proc.returncode != 0 or not marker:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise RuntimeError(f"vllm run-batch failed (exit {proc.returncode}):\n{tail}")
    timing = json.loads(marker[-1].split(" ", 1)[1])
    seconds = float(timing["seconds"])
    rows = [json.loads(ln) for ln in dst.read_text().splitlines() if ln.strip()]
    failed = [r for r in rows if r.get("error") or r["response"]["status_code"] != 200]
    if failed or len(rows) != w.requests:
        raise RuntimeError(f"run-batch: {len(failed)} failed of {len(rows)}: {failed[:1]}")
    out, prompt = _usage_totals([r["response"]["body"] for r in rows])
    return SideRun(
        "run-batch",
        w.model,
        round_no,
        w.requests,
        seconds,
        out,
        prompt,
        extra={
            "process_seconds": round(total, 2),
            "engine_start_seconds": round(total - seconds, 2),
            "cpu_s_process_with_start": round(cpu_total, 2),
            "cpu_s_processing": round(float(timing["cpu_s"]), 2),
        },
    )


# ---------------------------------------------------------------------------------------------
# Side (a): Backfill, API and worker processes


class BackfillDeployment:
    """``backfill api`` and ``backfill worker --beat`` on a scratch database, one engine."""

    def __init__(self, database_url: str, server: devengine.EngineServer, logs: Path) -> None:
        self.database_url = database_url
        self.server = server
        self.engine_url = server.url
        self.logs = logs
        self.port = devengine.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.node = f"bench-{secrets.token_hex(3)}"
        self.env = {
            **os.environ,
            "BACKFILL_DATABASE_URL": database_url,
            "BACKFILL_REDIS_NAMESPACE": f"bftput{secrets.token_hex(3)}",
            # Finalizing (writing the output file) happens on the maintenance tick; a
            # half-second tick keeps the wait for it small next to a 10-second run.
            "BACKFILL_REAPER_INTERVAL_S": "0.5",
            "BACKFILL_RATE_LIMIT_PER_S": "100000",
            "BACKFILL_RATE_LIMIT_BURST": "100000",
        }
        self.key = ""
        self.pids: dict[str, int] = {}

    @contextmanager
    def running(self) -> Iterator[BackfillDeployment]:
        repo = Repository.connect(self.database_url, pool_size=1)
        try:
            self.key = repo.create_api_key(repo.create_tenant("bench").id)
        finally:
            repo.close()
        with ExitStack() as stack:
            api = self._spawn("api", ["api", "--port", str(self.port)], stack)
            worker = self._spawn(
                "worker",
                ["worker", "--node", self.node, "--engine-url", self.engine_url, "--beat"],
                stack,
            )
            self.pids = {"bf_api": api.pid, "bf_worker": worker.pid}
            self._wait_ready(api, worker)
            yield self

    def _spawn(self, name: str, args: list[str], stack: ExitStack) -> subprocess.Popen[bytes]:
        log = stack.enter_context((self.logs / f"{name}.log").open("wb"))
        proc = subprocess.Popen(
            [*BACKFILL, *args], env=self.env, stdout=log, stderr=subprocess.STDOUT
        )
        stack.callback(_stop, proc)
        return proc

    def _wait_ready(self, *procs: subprocess.Popen[bytes]) -> None:
        repo = Repository.connect(self.database_url, pool_size=1)
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"backfill api or worker exited; logs in {self.logs}")
                try:
                    api_up = httpx.get(f"{self.base}/healthz", timeout=2).status_code == 200
                except httpx.HTTPError:
                    api_up = False
                if api_up and any(n.name == self.node for n in repo.nodes()):
                    return
                time.sleep(0.3)
        finally:
            repo.close()
        raise RuntimeError(f"backfill api or worker not ready in 120 s; logs in {self.logs}")

    def run(self, w: Workload, served: str, round_no: int) -> SideRun:
        lines = request_lines(w, served, w.requests, secrets.token_hex(4))
        headers = {"Authorization": f"Bearer {self.key}"}
        hits = prefix_cache_hits(self.engine_url)
        with (
            httpx.Client(base_url=self.base, headers=headers, timeout=120) as client,
            LoadSampler(self.engine_url) as sampler,
        ):
            uploaded = client.post(
                "/v1/files",
                files={"file": ("in.jsonl", _jsonl(lines))},
                data={"purpose": "batch"},
            )
            uploaded.raise_for_status()
            cpu0 = cpu_seconds(self.server.pid, self.pids)
            t0 = time.perf_counter()
            created = client.post(
                "/v1/batches",
                json={
                    "input_file_id": uploaded.json()["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
            created.raise_for_status()
            batch_id = created.json()["id"]
            items_done: float | None = None
            while True:
                batch = client.get(f"/v1/batches/{batch_id}").json()
                counts = batch["request_counts"]
                if items_done is None and counts["completed"] + counts["failed"] == w.requests:
                    items_done = time.perf_counter() - t0
                if batch["status"] in {"completed", "failed", "expired", "cancelled"}:
                    seconds = time.perf_counter() - t0
                    cpu = cpu_delta(cpu0, cpu_seconds(self.server.pid, self.pids))
                    break
                time.sleep(0.1)
            if batch["status"] != "completed" or counts["failed"]:
                raise RuntimeError(f"backfill batch ended {batch['status']}: {counts}")
            content = client.get(f"/v1/files/{batch['output_file_id']}/content").text
        rows = [json.loads(ln) for ln in content.splitlines() if ln.strip()]
        if len(rows) != w.requests:
            raise RuntimeError(f"backfill output has {len(rows)} lines, not {w.requests}")
        out, prompt = _usage_totals([r["response"]["body"] for r in rows])
        return SideRun(
            "backfill",
            w.model,
            round_no,
            w.requests,
            seconds,
            out,
            prompt,
            extra={
                "items_done_seconds": items_done if items_done is not None else seconds,
                "prefix_cache_hits": prefix_cache_hits(self.engine_url) - hits,
                **sampler.summary(),
                **cpu,
            },
        )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(45)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# One model: sweep, then rounds of the three sides in alternating order


def _say(message: str) -> None:
    print(f"[throughput] {message}", file=sys.stderr, flush=True)


def measure_model(w: Workload, logs: Path) -> dict[str, Any]:
    spec = devengine.MODELS[w.model]
    python, model_dir = devengine.provision(w.model)
    runs: list[SideRun] = []
    sweep: dict[int, float] = {}
    with ExitStack() as stack:
        server = devengine.start_model(
            w.model,
            kv_cache_gib=w.kv_cache_gib,
            max_num_seqs=MAX_NUM_SEQS,
            extra_args=["--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS)],
        )
        stack.callback(server.stop)
        database_url = stack.enter_context(scratch_database("bftput"))
        deployment = stack.enter_context(
            BackfillDeployment(database_url, server, logs / w.model).running()
        )
        for c in w.sweep:
            r = run_direct(server, w, spec.name, w.sweep_requests, c, -1)
            sweep[c] = r.tokens_per_s
            _say(f"{w.model} sweep: direct c={c}: {r.tokens_per_s:,.0f} tok/s")
        best_c = max(sweep, key=lambda c: sweep[c])
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bftput-rb-")))
        for round_no in range(w.rounds):
            order = SIDES if round_no % 2 == 0 else tuple(reversed(SIDES))
            for side in order:
                if side == "backfill":
                    run = deployment.run(w, spec.name, round_no)
                elif side == "run-batch":
                    run = run_vllm_batch(python, model_dir, w, round_no, workdir)
                else:
                    run = run_direct(server, w, spec.name, w.requests, best_c, round_no)
                runs.append(run)
                _say(
                    f"{w.model} round {round_no} {side}: {run.seconds:.1f} s, "
                    f"{run.tokens_per_s:,.0f} tok/s, {run.output_tokens} tokens {run.extra}"
                )
    return summarise(w, runs, sweep, best_c)


def summarise(
    w: Workload, runs: list[SideRun], sweep: dict[int, float], best_c: int
) -> dict[str, Any]:
    expected = w.requests * w.max_tokens
    sides: dict[str, dict[str, Any]] = {}
    for side in SIDES:
        mine = [r for r in runs if r.side == side]
        rates = [r.tokens_per_s for r in mine]
        best = max(mine, key=lambda r: r.tokens_per_s)
        sides[side] = {
            "best_tokens_per_s": best.tokens_per_s,
            "median_tokens_per_s": statistics.median(rates),
            "min_tokens_per_s": min(rates),
            "max_tokens_per_s": max(rates),
            "best_seconds": best.seconds,
            "output_tokens": sorted({r.output_tokens for r in mine}),
            "mean_prompt_tokens": best.prompt_tokens / best.requests,
            "best_tokens_per_cpu_s": max(r.tokens_per_cpu_s for r in mine),
        }
    mismatched = [asdict(r) for r in runs if r.output_tokens != expected]
    peer = max(sides["run-batch"]["best_tokens_per_s"], sides["direct"]["best_tokens_per_s"])
    peer_median = max(
        sides["run-batch"]["median_tokens_per_s"], sides["direct"]["median_tokens_per_s"]
    )
    return {
        "model": w.model,
        "workload": asdict(w),
        "expected_output_tokens": expected,
        "token_counts_match": not mismatched,
        "sides": sides,
        "direct_sweep_tokens_per_s": sweep,
        "direct_best_concurrency": best_c,
        "ratio_best": sides["backfill"]["best_tokens_per_s"] / peer,
        "ratio_median": sides["backfill"]["median_tokens_per_s"] / peer_median,
        "ratio_per_cpu_s": sides["backfill"]["best_tokens_per_cpu_s"]
        / max(
            sides["run-batch"]["best_tokens_per_cpu_s"], sides["direct"]["best_tokens_per_cpu_s"]
        ),
        "runs": [
            asdict(r) | {"tokens_per_s": r.tokens_per_s, "tokens_per_cpu_s": r.tokens_per_cpu_s}
            for r in runs
        ],
    }


# ---------------------------------------------------------------------------------------------
# Report


def _rows(results: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    rows: list[tuple[Any, ...]] = []
    for res in results:
        w = res["workload"]
        for side in SIDES:
            s = res["sides"][side]
            label = f"direct c={res['direct_best_concurrency']}" if side == "direct" else side
            rows.append(
                (
                    res["model"],
                    label,
                    w["requests"],
                    f"{s['mean_prompt_tokens']:.0f}/{w['max_tokens']}",
                    s["best_seconds"],
                    s["best_tokens_per_s"],
                    f"{s['min_tokens_per_s']:,.0f}-{s['max_tokens_per_s']:,.0f}",
                    ",".join(str(t) for t in s["output_tokens"]),
                    s["best_tokens_per_cpu_s"],
                )
            )
        rows.append(
            (
                res["model"],
                "Backfill / best peer",
                "",
                "",
                "",
                res["ratio_best"],
                f"median {res['ratio_median']:.3f}",
                f"goal >= {w['goal']}",
                res["ratio_per_cpu_s"],
            )
        )
    return rows


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib  # noqa: PLC0415 - plotting loads only when a report is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 4))
    axes_list = list(axes) if len(results) > 1 else [axes]
    colours = {"backfill": "#2b6cb0", "run-batch": "#718096", "direct": "#a0aec0"}
    for ax, res in zip(axes_list, results, strict=True):
        names, best, low, high = [], [], [], []
        for side in SIDES:
            s = res["sides"][side]
            names.append(
                f"direct\nc={res['direct_best_concurrency']}" if side == "direct" else side
            )
            best.append(s["best_tokens_per_s"])
            low.append(s["best_tokens_per_s"] - s["min_tokens_per_s"])
            high.append(0.0)
        ax.bar(names, best, color=[colours[s] for s in SIDES], yerr=[low, high], capsize=4)
        for x, v in enumerate(best):
            ax.text(x, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
        w = res["workload"]
        ax.set_title(
            f"{res['model']}: {w['requests']} requests x {w['max_tokens']} tokens\n"
            f"Backfill / best peer = {res['ratio_best']:.2f} (goal >= {w['goal']})",
            fontsize=10,
        )
        ax.set_ylabel("output tokens/s (best of rounds; bar down to worst)")
    fig.suptitle(f"Batch throughput, vLLM CPU, {machine()}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument(
        "--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2 (default both)"
    )
    p.add_argument("--rounds", type=int, default=None, help="override rounds per model")
    p.add_argument("--requests", type=int, default=None, help="override requests per model")
    args = p.parse_args(argv)
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    chosen: list[Workload] = []
    for w in workloads(args.quick):
        if w.model not in wanted:
            continue
        overrides: dict[str, Any] = {}
        if args.rounds:
            overrides["rounds"] = args.rounds
        if args.requests:
            overrides["requests"] = args.requests
        chosen.append(Workload(**{**asdict(w), **overrides}))
    logs = OUT_DIR / "throughput-logs"
    for w in chosen:
        (logs / w.model).mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    results = [measure_model(w, logs) for w in chosen]
    print(
        table(
            [
                "model", "side", "requests", "prompt/out tok", "best s",
                "out tok/s (best)", "spread tok/s", "out tokens", "out tok/CPU-s",
            ],
            _rows(results),
        )
    )  # fmt: skip
    for res in results:
        sweep = ", ".join(f"c={c}: {v:,.0f}" for c, v in res["direct_sweep_tokens_per_s"].items())
        print(
            f"{res['model']} direct sweep (tok/s, {res['workload']['sweep_requests']} req): {sweep}"
        )
        print(f"{res['model']} ratio Backfill / best peer: {res['ratio_best']:.3f} "
              f"(goal >= {res['workload']['goal']})")  # fmt: skip
        if not res["token_counts_match"]:
            print(f"{res['model']}: WARNING output token counts differ between runs")
    plot_path = PLOT if not args.quick else OUT_DIR / "throughput-quick.png"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    plot(results, plot_path)
    print(f"plot: {plot_path}")
    by_model = {r["model"]: r for r in results}
    headline = by_model.get("smollm2") or results[0]
    details = {
        "command": "python -m bench.throughput" + (" --quick" if args.quick else ""),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": started,
        "plot": str(plot_path),
        "models": by_model,
    }
    finish(
        NAME,
        f"{headline['model']}_ratio",
        headline["ratio_best"],
        ">=",
        headline["workload"]["goal"],
        details,
    )


if __name__ == "__main__":
    main()
