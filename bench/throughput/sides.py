"""The three sides of the throughput benchmark, each timed over the same requests: Backfill
end to end (API and worker processes, :class:`bench.stack.BackfillStack`), ``vllm
run-batch`` (vLLM's own runner, engine start left out) and a direct asyncio client.
"""

from __future__ import annotations

import asyncio
import json
import resource
import secrets
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.stack import BATCH_ENDED, BackfillStack, create_batch, upload_input
from bench.throughput.engine import (
    LoadSampler,
    cpu_delta,
    cpu_seconds,
    engine_args,
    engine_env,
    prefix_cache_hits,
)
from bench.throughput.workload import SideRun, Workload, jsonl, request_lines, usage_totals
from devkit import devengine

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
    out, prompt = usage_totals(bodies)
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
    src.write_bytes(jsonl(lines))
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
    return _batch_run(
        "run-batch",
        w,
        round_no,
        seconds,
        rows,
        {
            "process_seconds": round(total, 2),
            "engine_start_seconds": round(total - seconds, 2),
            "cpu_s_process_with_start": round(cpu_total, 2),
            "cpu_s_processing": round(float(timing["cpu_s"]), 2),
        },
    )


def _batch_run(
    side: str, w: Workload, round_no: int, seconds: float, rows: list[Any], extra: dict[str, Any]
) -> SideRun:
    """A batch side's run of ``w``: its output ``rows`` (one per request, as OpenAI's batch
    output lines) counted."""
    out, prompt = usage_totals([r["response"]["body"] for r in rows])
    return SideRun(side, w.model, round_no, w.requests, seconds, out, prompt, extra=extra)


# ---------------------------------------------------------------------------------------------
# Side (a): Backfill, API and worker processes

THROUGHPUT_SETTINGS = {
    # Finalizing (writing the output file) happens on the maintenance tick; a half-second tick
    # keeps the wait for it small next to a 10-second run.
    "reaper_interval_s": "0.5",
}
"""Settings of the Backfill stack this side runs on (:class:`bench.stack.BackfillStack`)."""


def run_backfill(
    stack: BackfillStack,
    server: devengine.EngineServer,
    w: Workload,
    served: str,
    round_no: int,
) -> SideRun:
    """Upload the requests, then time ``POST /v1/batches`` until the batch is ``completed``
    (its output file written); items done (all results durable) is reported beside it."""
    lines = request_lines(w, served, w.requests, secrets.token_hex(4))
    hits = prefix_cache_hits(stack.engine_url)
    with (
        httpx.Client(base_url=stack.base, headers=stack.auth, timeout=120) as client,
        LoadSampler(stack.engine_url) as sampler,
    ):
        input_file_id = upload_input(client, jsonl(lines), "in.jsonl")
        cpu0 = cpu_seconds(server.pid, stack.pids)
        t0 = time.perf_counter()
        batch_id = create_batch(client, input_file_id)
        items_done: float | None = None
        while True:
            batch = client.get(f"/v1/batches/{batch_id}").json()
            counts = batch["request_counts"]
            if items_done is None and counts["completed"] + counts["failed"] == w.requests:
                items_done = time.perf_counter() - t0
            if batch["status"] in BATCH_ENDED:
                seconds = time.perf_counter() - t0
                cpu = cpu_delta(cpu0, cpu_seconds(server.pid, stack.pids))
                break
            time.sleep(0.1)
        if batch["status"] != "completed" or counts["failed"]:
            raise RuntimeError(f"backfill batch ended {batch['status']}: {counts}")
        content = client.get(f"/v1/files/{batch['output_file_id']}/content").text
    rows = [json.loads(ln) for ln in content.splitlines() if ln.strip()]
    if len(rows) != w.requests:
        raise RuntimeError(f"backfill output has {len(rows)} lines, not {w.requests}")
    return _batch_run(
        "backfill",
        w,
        round_no,
        seconds,
        rows,
        {
            "items_done_seconds": items_done if items_done is not None else seconds,
            "prefix_cache_hits": prefix_cache_hits(stack.engine_url) - hits,
            **sampler.summary(),
            **cpu,
        },
    )
