"""Summarisation jobs end to end on the real CPU engine, against the same requests sent
straight as batches, and the memory a large input costs the client and the API.

1. A corpus as Parquet (``id``, ``text``): lengths drawn from a log-normal (most documents a
   few hundred tokens, a long tail), ``--long-share`` of them longer than the model's context;
   the text is sentences of the bundled public-domain documents, shuffled with a seed.
2. **job**: ``backfill summarize corpus.parquet`` (the CLI, as a user runs it), the job
   followed to its end, ``backfill results JOB -o summaries.parquet``: wall time from the
   first byte read to the last row written, and output tokens/s.
3. **batches**: the very request lines the job's batches carried (map and reduce), sent
   again as batch files through the Batch API in the order the work allows (the map steps,
   then each level of reduce steps once the level below ended, as a client with plain
   batches must: a reduce step reads the summaries below it), followed to their end, each
   batch's output (and error) file downloaded to disk once its wave ended: the building
   block with no job layer (no documents to read or split, no driver, no table written).
   Wall time from the first upload to the last output file saved (the request lines are
   fetched before the clock starts: they are the job's own, not built again). The engine's
   prefix cache is emptied first, so this side does not find the job's prompts already
   computed.
4. **memory**: ``backfill summarize`` on inputs of ``--memory-mb`` MiB of text (short
   documents, so the engine counts nothing; the job is cancelled once sent): each client's
   own peak RSS, and the API process's peak RSS so far (``VmHWM``) after each, smallest
   first. Bounded: the largest input raises neither.

The figure is the job layer's overhead on output tokens/s: ``1 - job / batches`` (goal
<= 0.05). Both sides end with the results on disk: the job side's wall time includes the
CLI reading and sending the corpus, splitting, the job's driver and ``backfill results``
writing the Parquet; the batches side's includes uploads, the waits between waves and the
output files' download, but not building the request lines (it reuses the job's).
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pyarrow as pa
import pyarrow.parquet as pq

from backfill.config import get_settings, libpq_url
from backfill.summarize.reduce_plan import plan_reduce
from bench.common import OUT_DIR, finish, parser
from bench.stack import BACKFILL, BackfillStack, upload_batch
from bench.throughput.prefix_timeline import CpuWatch
from devkit import devengine
from devkit.demo_job import DOCS

NAME = "summarize"
GOAL = 0.05
TERMINAL = {"completed", "failed", "expired", "cancelled"}
BYTES_PER_TOKEN = 4.5
"""English in the demo models' tokenizer, about (the corpus is sized in bytes)."""


def say(message: str) -> None:
    print(f"[{NAME}] {message}", file=sys.stderr, flush=True)


def sentences() -> list[str]:
    text = " ".join(p.read_text() for p in sorted(DOCS.glob("*.txt")))
    return [s.strip() for s in re.split(r"(?<=[.!?;])\s+", text) if len(s.strip()) > 20]


def document_lengths(n: int, context_tokens: int, long_share: float, seed: int) -> list[int]:
    """Byte lengths: log-normal around ~400 tokens for most, 1.5-4x the context for
    ``long_share`` of them (at least one)."""
    rng = random.Random(seed)
    longs = max(1, round(n * long_share))
    context_bytes = context_tokens * BYTES_PER_TOKEN
    short = [
        int(min(context_bytes * 0.8, max(200.0, rng.lognormvariate(7.5, 0.8))))
        for _ in range(n - longs)
    ]
    long = [int(context_bytes * rng.uniform(1.5, 4.0)) for _ in range(longs)]
    lengths = short + long
    rng.shuffle(lengths)
    return lengths


def write_corpus(path: Path, lengths: Sequence[int], seed: int, rows_per_group: int = 2048) -> int:
    """A Parquet file of one document per length, written a row group at a time; its size."""
    rng = random.Random(seed)
    pool = sentences()
    schema = pa.schema([("id", pa.string()), ("text", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, len(lengths), rows_per_group):
            ids, texts = [], []
            for i, size in enumerate(lengths[start : start + rows_per_group], start=start):
                parts: list[str] = []
                total = 0
                while total < size:
                    parts.append(rng.choice(pool))
                    total += len(parts[-1]) + 1
                ids.append(f"doc-{i}")
                texts.append(" ".join(parts))
            writer.write_table(pa.table({"id": ids, "text": texts}, schema=schema))
    return path.stat().st_size


class ClientFailed(RuntimeError):
    """A ``backfill`` command that ended in an error, with what it cost before it did."""

    def __init__(self, message: str, wall_s: float, peak_rss: int) -> None:
        super().__init__(message)
        self.wall_s, self.peak_rss = wall_s, peak_rss


def run_client(args: Sequence[str], env: dict[str, str]) -> tuple[str, float, int]:
    """A ``backfill`` command's stdout, its wall seconds and its own peak RSS (bytes, from
    ``wait4``: that process's alone, not the largest child's so far)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([*BACKFILL, *args], stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        printed, said = out.read().decode(), err.read().decode(errors="replace")
    if proc.returncode != 0:
        message = f"backfill {' '.join(args)}: {said[-2000:]}"
        raise ClientFailed(message, wall, usage.ru_maxrss * 1024)
    return printed, wall, usage.ru_maxrss * 1024


def peak_rss(pid: int) -> int:
    """A process's peak RSS so far (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_job(client: httpx.Client, job_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job: dict[str, Any] = client.get(f"/v1/summary_jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            return job
        time.sleep(0.5)
    raise RuntimeError(f"summary job {job_id} did not end in {timeout_s:.0f} s")


def wait_batches(
    client: httpx.Client, ids: Sequence[str], timeout_s: float
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batches = [client.get(f"/v1/batches/{b}").json() for b in ids]
        if all(b["status"] in TERMINAL for b in batches):
            return batches
        time.sleep(0.5)
    raise RuntimeError(f"batches did not end in {timeout_s:.0f} s")


TIMELINE = """
SELECT b.id, b.created_at, min(i.started_at) AS first_start, max(i.finished_at) AS last_end,
       count(*) AS items,
       coalesce(sum(extract(epoch FROM i.started_at - b.created_at)), 0) AS queued_s
FROM jobs b JOIN items i ON i.job_id = b.id
WHERE b.id = ANY(%s) GROUP BY b.id, b.created_at ORDER BY b.created_at
"""

BUSY = "SELECT started_at, finished_at FROM items WHERE job_id = ANY(%s) AND started_at IS NOT NULL"


def timeline(database_url: str, batch_ids: Sequence[str], wall0: float) -> dict[str, Any]:
    """Where a side's time went, from the stored batches and items: each batch's creation,
    first claim and last end (seconds after ``wall0``, the side's start),
    the items' mean wait between their batch's creation and their claim, and the seconds in
    which no item of the side ran (the engine idle)."""
    with psycopg.connect(libpq_url(database_url)) as conn:
        rows = conn.execute(TIMELINE, (list(batch_ids),)).fetchall()
        spans = conn.execute(BUSY, (list(batch_ids),)).fetchall()

    def at(ts: Any) -> float | None:
        return None if ts is None else round(ts.timestamp() - wall0, 1)

    batches = [
        {"created": at(r[1]), "first_claim": at(r[2]), "last_end": at(r[3]), "items": r[4]}
        for r in rows
    ]
    items = sum(r[4] for r in rows)
    queued = sum(float(r[5]) for r in rows)
    idle, covered, running = 0.0, wall0, 0.0
    for start, end in sorted((s.timestamp(), (e or s).timestamp()) for s, e in spans):
        idle += max(0.0, start - covered)
        covered = max(covered, end)
        running += end - start
    last = max((r[3].timestamp() for r in rows if r[3] is not None), default=wall0)
    return {
        "batches": batches,
        "first_batch_s": batches[0]["created"] if batches else None,
        "last_item_end_s": round(last - wall0, 1),
        "mean_item_queued_s": round(queued / items, 2) if items else 0.0,
        "engine_idle_s": round(idle, 1),
        "mean_item_run_s": round(running / len(spans), 2) if spans else 0.0,
        "mean_in_flight": round(running / max(1e-9, covered - wall0 - idle), 1),
    }


def job_side(
    stack: BackfillStack,
    corpus: Path,
    model: str,
    summary_tokens: int,
    env: dict[str, str],
    cpu: CpuWatch,
) -> dict[str, Any]:
    out = corpus.with_name("summaries.parquet")
    cpu.start()
    t0, wall0 = time.perf_counter(), time.time()
    printed, send_s, client_peak = run_client(
        [
            "summarize", str(corpus), "--text-column", "text", "--id-column", "id",
            "--model", model, "--max-summary-tokens", str(summary_tokens), "--window", "24h",
        ],
        env,
    )  # fmt: skip
    job_id = printed.strip().splitlines()[-1]
    with httpx.Client(base_url=stack.base, headers=stack.auth, timeout=60) as client:
        job = wait_job(client, job_id, 3600)
    seen_end = time.perf_counter() - t0
    _, results_s, _ = run_client(["results", job_id, "-o", str(out)], env)
    wall = time.perf_counter() - t0
    cpu_s = cpu.stop()
    rows = pq.read_metadata(out).num_rows
    tokens = int(job["progress"]["completion_tokens"])
    return {
        "job_id": job_id,
        "fan_in": job["fan_in"],
        "status": job["status"],
        "documents": job["progress"]["documents"],
        "steps": job["progress"]["steps_done"],
        "batches": job["batches"],
        "rows_written": rows,
        "wall_s": round(wall, 1),
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "client_peak_rss_mb": round(client_peak / 2**20, 1),
        "cpu_s": cpu_s,
        "phases": {
            "summarize_cli_s": round(send_s, 1),
            "job_seen_ended_s": round(seen_end, 1),
            "results_cli_s": round(results_s, 1),
            **timeline(stack.database_url, job["batches"], wall0),
        },
    }


def levels(lines: Sequence[bytes], fan_in: int) -> list[list[bytes]]:
    """The request lines in waves a client can send them in: the map steps first, then each
    level of reduce steps (a reduce step reads the summaries of the level below it).

    A line's custom id is ``seq:node``; a document of ``c`` chunks has nodes ``0..c-1`` (its
    map steps) and then the reduce tree :func:`plan_reduce` makes over them."""
    nodes: dict[int, set[int]] = {}
    for line in lines:
        seq, node = json.loads(line)["custom_id"].split(":")
        nodes.setdefault(int(seq), set()).add(int(node))
    level: dict[tuple[int, int], int] = {}
    for seq, present in nodes.items():
        total = max(present) + 1
        fits = (c for c in range(1, total + 1) if plan_reduce(c, fan_in).nodes == total)
        chunks = next(fits, total)  # a step missing (failed): all read as map steps
        for step in plan_reduce(chunks, fan_in).steps:
            level[(seq, step.node)] = step.level
    waves: dict[int, list[bytes]] = {}
    for line in lines:
        seq, node = json.loads(line)["custom_id"].split(":")
        waves.setdefault(level.get((int(seq), int(node)), 0), []).append(line)
    return [waves[k] for k in sorted(waves)]


def reset_prefix_cache(engine_url: str) -> None:
    """Empty the engine's prefix cache, so the second side does not find the first side's
    prompts computed (vLLM's dev endpoint; it refuses while blocks are held: retried)."""
    for _ in range(60):
        reply = httpx.post(f"{engine_url}/reset_prefix_cache", timeout=30)
        reply.raise_for_status()
        if reply.json().get("success"):
            return
        time.sleep(1)
    raise RuntimeError("the engine's prefix cache could not be reset")


def send_batches(client: httpx.Client, contents: Sequence[bytes], tag: str) -> list[str]:
    return [upload_batch(client, c, f"{tag}-{n}.jsonl") for n, c in enumerate(contents)]


def download_file(client: httpx.Client, file_id: str, path: Path) -> tuple[int, int]:
    """A file's content streamed to ``path``, as a Batch API user saves a batch's output;
    its lines and bytes."""
    lines = size = 0
    with client.stream("GET", f"/v1/files/{file_id}/content") as reply, path.open("wb") as out:
        reply.raise_for_status()
        for chunk in reply.iter_bytes():
            out.write(chunk)
            lines += chunk.count(b"\n")
            size += len(chunk)
    return lines, size


def batches_side(
    stack: BackfillStack,
    batch_ids: Sequence[str],
    fan_in: int,
    max_lines: int,
    outputs: Path,
    cpu: CpuWatch,
) -> dict[str, Any]:
    """The job's request lines sent again as plain batches, in the same dependent order the
    job must keep: the map steps first, each level of reduce steps once the level below it
    ended (a client cannot send a reduce step before the summaries it reads exist). Each
    wave's output (and error) files are downloaded to ``outputs`` once the wave ended: a
    client of plain batches has its results only then, and needs them for the next wave's
    reduce prompts."""
    outputs.mkdir(exist_ok=True)
    with httpx.Client(base_url=stack.base, headers=stack.auth, timeout=300) as client:
        lines: list[bytes] = []
        for b in batch_ids:
            source = client.get(f"/v1/batches/{b}").json()["input_file_id"]
            content = client.get(f"/v1/files/{source}/content").content
            lines += [line for line in content.splitlines() if line.strip()]
        waves = levels(lines, fan_in)
        cpu.start()
        t0, wall0 = time.perf_counter(), time.time()
        ids: list[str] = []
        downloaded = {"files": 0, "lines": 0, "bytes": 0, "seconds": 0.0}
        for k, wave in enumerate(waves):
            files = [
                b"\n".join(wave[i : i + max_lines]) + b"\n" for i in range(0, len(wave), max_lines)
            ]
            sent = send_batches(client, files, f"wave{k}")
            ended_wave = wait_batches(client, sent, 3600)
            d0 = time.perf_counter()
            for batch in ended_wave:
                for key in ("output_file_id", "error_file_id"):
                    if batch.get(key):
                        got = download_file(client, batch[key], outputs / f"{batch[key]}.jsonl")
                        downloaded["files"] += 1
                        downloaded["lines"] += got[0]
                        downloaded["bytes"] += got[1]
            downloaded["seconds"] += time.perf_counter() - d0
            ids += sent
        ended = [client.get(f"/v1/batches/{b}").json() for b in ids]
        wall = time.perf_counter() - t0
        cpu_s = cpu.stop()
    tokens = sum(int((b.get("usage") or {}).get("output_tokens", 0)) for b in ended)
    return {
        "batches": len(ids),
        "waves": [len(w) for w in waves],
        "requests": sum(int(b["request_counts"]["total"]) for b in ended),
        "statuses": sorted({b["status"] for b in ended}),
        "wall_s": round(wall, 1),
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall else 0.0,
        "cpu_s": cpu_s,
        "downloaded": {
            "files": downloaded["files"],
            "lines": downloaded["lines"],
            "mib": round(downloaded["bytes"] / 2**20, 2),
        },
        "phases": {
            "download_s": round(downloaded["seconds"], 1),
            **timeline(stack.database_url, ids, wall0),
        },
    }


MEMORY_WINDOW = "168h"
"""The memory run's window: the longest the API takes by default, so a 1 GiB input's forecast
(days on one CPU engine) is not refused before its job starts."""


def memory_side(
    stack: BackfillStack, workdir: Path, sizes_mb: Sequence[int], model: str, env: dict[str, str]
) -> list[dict[str, Any]]:
    """Client and API peak RSS sending inputs of each size (short documents: no counting);
    the job is cancelled once sent."""
    out = []
    api_pid = stack.pids["bf_api"]
    for size_mb in sizes_mb:
        path = workdir / f"memory-{size_mb}.parquet"
        n = size_mb * 2**20 // 1500
        write_corpus(path, [1400] * n, seed=size_mb)
        try:
            printed, wall, client_peak = run_client(
                [
                    "summarize", str(path), "--text-column", "text", "--id-column", "id",
                    "--model", model, "--max-summary-tokens", "64", "--window", MEMORY_WINDOW,
                ],
                env,
            )  # fmt: skip
            job_id: str | None = printed.strip().splitlines()[-1]
            error = None
        except ClientFailed as exc:  # a start refused on its forecast still sent everything
            job_id, wall, client_peak, error = None, exc.wall_s, exc.peak_rss, str(exc)[-300:]
        if job_id:
            with httpx.Client(base_url=stack.base, headers=stack.auth, timeout=60) as client:
                client.post(f"/v1/summary_jobs/{job_id}/cancel")
        out.append(
            {
                "text_mb": round(n * 1400 / 2**20, 1),
                "parquet_mb": round(path.stat().st_size / 2**20, 1),
                "documents": n,
                "send_s": round(wall, 1),
                "client_peak_rss_mb": round(client_peak / 2**20, 1),
                "api_peak_rss_mb": round(peak_rss(api_pid) / 2**20, 1),
                "error": error,
            }
        )
        say(f"memory: {out[-1]}")
        path.unlink()
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--model", default=None, help="tiny or smollm2 (default: smollm2; tiny quick)")
    p.add_argument("--documents", type=int, default=None, help="2,000 (quick: 200)")
    p.add_argument("--long-share", type=float, default=0.05)
    p.add_argument("--summary-tokens", type=int, default=64)
    p.add_argument(
        "--memory-mb", default=None, help="input sizes for the memory run (64,1024; quick: 8,32)"
    )
    p.add_argument("--seed", type=int, default=37)
    args = p.parse_args(argv)
    model = args.model or ("tiny" if args.quick else "smollm2")
    n = args.documents or (200 if args.quick else 2000)
    sizes = [int(s) for s in (args.memory_mb or ("8,32" if args.quick else "64,1024")).split(",")]
    spec = devengine.MODELS[model]
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="bfsum-") as tmp:
        workdir = Path(tmp)
        lengths = document_lengths(n, spec.max_model_len, args.long_share, args.seed)
        corpus = workdir / "corpus.parquet"
        corpus_bytes = write_corpus(corpus, lengths, args.seed)
        say(f"corpus: {n} documents, {corpus_bytes / 2**20:.1f} MiB, model {model}")
        # vLLM's dev endpoints on: the prefix cache is emptied between the sides.
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        try:
            server = devengine.start_model(model, kv_cache_gib=1)
        finally:
            os.environ.pop("VLLM_SERVER_DEV_MODE", None)
        stack.callback(server.stop)
        backfill = stack.enter_context(
            BackfillStack(server.url, OUT_DIR / "logs" / NAME, {}).running()
        )
        env = {**os.environ, "BACKFILL_API_URL": backfill.base, "BACKFILL_API_KEY": backfill.key}
        # CPU seconds of each side by process (engine, API, worker, this one; the machine's
        # whole): on a 2-core machine what Backfill's processes take, the engine does not get.
        cpu = CpuWatch(server.pid, backfill.pids)
        job = job_side(backfill, corpus, server.served_model_name, args.summary_tokens, env, cpu)
        say(f"job: {json.dumps({k: v for k, v in job.items() if k != 'batches'})}")
        reset_prefix_cache(server.url)
        direct = batches_side(
            backfill,
            job["batches"],
            job["fan_in"],
            get_settings().max_lines_per_batch,
            workdir / "outputs",
            cpu,
        )
        say(f"batches: {json.dumps(direct)}")
        memory = memory_side(backfill, workdir, sizes, server.served_model_name, env)
    overhead = 1 - job["tokens_per_s"] / direct["tokens_per_s"] if direct["tokens_per_s"] else 1.0
    long_docs = sum(1 for x in lengths if x > spec.max_model_len * BYTES_PER_TOKEN)
    finish(
        NAME,
        "overhead",
        round(overhead, 3),
        "<=",
        GOAL,
        {
            "model": model,
            "documents": n,
            "longer_than_context": long_docs,
            "corpus_mib": round(corpus_bytes / 2**20, 2),
            "job": {k: v for k, v in job.items() if k != "batches"},
            "batches": direct,
            "memory": memory,
        },
        holds=job["status"] == "completed" and job["rows_written"] == n,
    )


if __name__ == "__main__":
    main()
