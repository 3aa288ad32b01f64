"""Shared prompt prefixes reserved once (issue 36's Measure), on the real CPU engine.

A summarisation job whose lines all start with one ~1,000-token instruction (documents of
200-600 tokens, 200 output tokens, ``ignore_eos``) runs on the real ``backfill api`` and
``backfill worker --beat`` processes beside one vLLM CPU server whose KV pool is small
(``num_gpu_blocks_override``), so batch slack binds. In one run, on one engine:

* **whole** -- the job as before the feature: its prefixes never looked for (the job is
  recorded as taken for prefixes already, as ``tests/e2e/test_prefixes.py`` does), so every
  item reserves its whole prompt;
* **shared** -- the same job found by the worker's prefix pass: the instruction is reserved
  once on the node and each item reserves its own document and output;
* **client** -- an asyncio client sending the same requests straight to the engine with as
  many in flight as the shared side's peak.

Each tenant has a cache salt of its own, so neither Backfill side warms the other's prefix
cache. While a Backfill side runs, the ledger is sampled around an engine reading (as the e2e
test does): batch sequences at once (peak and mean) and the engine's allocated KV against what
the ledger reserved; the most it held above the reservation over the samples is reported.
* **run-batch** -- ``vllm run-batch`` on the same requests, its in-process engine started with
  the same pool (``bench.throughput``'s driver, timed from its own processing coroutine so the
  engine's start is left out); vLLM schedules every request itself, no cap. After the others,
  so the two engines never share the cores; ``--no-run-batch`` leaves it out.

Every item generates exactly ``max_tokens`` (``ignore_eos``), so items started together end
together; with ``--vary-output`` each item's ``max_tokens`` is drawn from half to 1.5x the mean
instead (seeded, the same on every side), as real summaries end apart. That mattered before
the worker held a group back for its first holder (``backfill.dispatch.prefix_starts``): an
item then leaned on the prefix only while an attempt holding it had prefilled, else reserved
its whole prompt, so a wave that started and ended together started the next one cold.

Closes on ``prefix: concurrency_ratio=<x> (goal >= 2.0)``; the verdict also needs the
throughput ratio (>= 1.5), the straight-client ratio (>= 0.95) and nothing allocated above the
reservation.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from backfill.config import get_settings
from backfill.dispatch import DispatchConfig
from backfill.engine_metrics import EnginePool, parse_cache_config, parse_engine_load
from backfill.ledger import Ledger
from backfill.maintenance import pool_policy
from backfill.observe import engine_held_tokens, reserved_around
from backfill.states import ItemState, JobState
from backfill.store import NewItem, Repository
from backfill.work_bell import work_bell
from bench.common import OUT_DIR, finish, machine, parser, table
from bench.stack import BackfillStack
from bench.throughput.engine import engine_args, engine_env
from bench.throughput.prefix_timeline import CpuWatch, backfill_intervals, timeline
from bench.throughput.prefix_workload import (
    CONCURRENCY_GOAL,
    PrefixWorkload,
    SideResult,
    doc_lengths,
    document,
    instruction,
    output_lengths,
    over_reserved,
    prompt,
    request_body,
    rules_for,
    side_rows,
    verdict,
    workload,
)
from bench.throughput.sides import RUN_BATCH_DRIVER
from devkit import devengine
from devkit.demo_job import DOCS

NAME = "prefix"
ENDPOINT = "/v1/chat/completions"
"""Chat on every side: this vLLM's ``run-batch`` takes no ``/v1/completions`` lines."""
SIDE_TIMEOUT_S = 1800.0


CPU_BLOCK = 128
"""The CPU engine's default KV block (tokens), in which the workload's pool is counted."""


def say(message: str) -> None:
    print(f"[prefix] {message}", file=sys.stderr, flush=True)


def _count(url: str, model: str, text_: str) -> int:
    answer = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text_}, timeout=60)
    answer.raise_for_status()
    return int(answer.json()["count"])


def build_prompts(url: str, w: PrefixWorkload) -> tuple[str, list[str]]:
    """The shared instruction (about ``w.instruction_tokens``) and each item's prompt."""
    one, ten = _count(url, w.model, instruction(1)), _count(url, w.model, instruction(10))
    shared = instruction(rules_for(w.instruction_tokens, one, ten))
    corpus = "\n\n".join(p.read_text().strip() for p in sorted(DOCS.glob("*.txt")))
    sample = corpus[:8000]
    chars_per_token = len(sample) / max(1, _count(url, w.model, sample))
    lengths = doc_lengths(w.items, *w.doc_tokens)
    prompts = [
        prompt(shared, document(corpus, i, int(n * chars_per_token))) for i, n in enumerate(lengths)
    ]
    return shared, prompts


def _submit(repo: Repository, w: PrefixWorkload, prompts: Sequence[str], *, find: bool) -> str:
    """The job straight into the store (as the e2e test does): with ``find`` False it is
    recorded as taken for prefixes already, so no worker looks for them."""
    tenant = repo.tenants.create_tenant(
        f"prefix-{'shared' if find else 'whole'}-{secrets.token_hex(3)}"
    )
    f = repo.files.create_file(tenant.id, "batch", "in.jsonl", b"-")
    job = repo.jobs.create_job(
        tenant.id, f.id, ENDPOINT, "24h", datetime.now(UTC) + timedelta(hours=24)
    )
    outputs = output_lengths(len(prompts), w.max_tokens, w.vary_output)
    repo.ingest.insert_items(
        job.id,
        [
            NewItem(i, f"r{i}", json.dumps(request_body(w.model, p, n)), n)
            for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))
        ],
    )
    with repo.engine.begin() as conn:
        conn.execute(
            text(
                "UPDATE jobs SET model = :m, prefixes_taken_at = "
                "CASE WHEN :find THEN NULL ELSE now() END, prefixes_ended_at = "
                "CASE WHEN :find THEN NULL ELSE now() END WHERE id = :j"
            ),
            {"m": w.model, "find": find, "j": job.id},
        )
    return job.id


def _output_tokens(repo: Repository, job: str) -> int:
    with repo.engine.connect() as conn:
        return int(
            conn.execute(
                text(
                    "SELECT coalesce(sum(a.output_tokens), 0) FROM attempts a "
                    "JOIN items i ON i.id = a.item_id WHERE i.job_id = :j "
                    "AND a.outcome = 'succeeded'"
                ),
                {"j": job},
            ).scalar_one()
        )


def _leaned(repo: Repository, job: str) -> int:
    with repo.engine.connect() as conn:
        return int(
            conn.execute(
                text("SELECT count(*) FROM items WHERE job_id = :j AND lease_prefix_tokens > 0"),
                {"j": job},
            ).scalar_one()
        )


def _first_seconds(repo: Repository, job: str) -> dict[str, float | None]:
    """From the job in progress: when its prefix pass ended (the claims of a node that looks
    for prefixes leave its items until then) and when its first attempt started."""
    with repo.engine.connect() as conn:
        row = conn.execute(
            text(
                "SELECT EXTRACT(EPOCH FROM (j.prefixes_ended_at - j.in_progress_at)), "
                "EXTRACT(EPOCH FROM ((SELECT min(a.started_at) FROM attempts a "
                "JOIN items i ON i.id = a.item_id WHERE i.job_id = j.id) - j.in_progress_at)) "
                "FROM jobs j WHERE j.id = :j"
            ),
            {"j": job},
        ).one()
    return {
        "prefix_pass_ended_s": None if row[0] is None else round(float(row[0]), 2),
        "first_start_s": None if row[1] is None else round(float(row[1]), 2),
    }


def run_backfill(
    stack: BackfillStack,
    repo: Repository,
    ledger: Ledger,
    pool: EnginePool,
    w: PrefixWorkload,
    prompts: Sequence[str],
    *,
    share: bool,
    cpu: CpuWatch,
) -> SideResult:
    side = "shared" if share else "whole"
    job = _submit(repo, w, prompts, find=share)
    # Timed from the job in progress, the prefix pass included: the worker claims the job's
    # first items as the pass runs (those it has not grouped yet reserve their whole prompts).
    cpu.start()
    t0 = time.perf_counter()
    repo.jobs.move_job(job, JobState.IN_PROGRESS)
    # As a create's ingest does once its items are claimable (``backfill.work_bell``).
    work_bell(get_settings().redis_url, stack.namespace).ring(w.model)
    result = SideResult(side, w.items, 0.0, 0)
    metrics_url = f"{stack.engine_url}/metrics"
    end = time.monotonic() + SIDE_TIMEOUT_S
    with httpx.Client(timeout=10) as client:
        while repo.stats.counted_states(job).get(ItemState.SUCCEEDED, 0) < w.items:
            if time.monotonic() > end:
                raise RuntimeError(f"{side}: job not done: {repo.stats.counted_states(job)}")
            before = ledger.snapshot(stack.node)
            load = parse_engine_load(client.get(metrics_url).text)
            after = ledger.snapshot(stack.node)
            if before is not None and after is not None:
                held = engine_held_tokens(
                    load.kv_cache_usage_perc, pool.capacity_tokens, pool.block_size
                )
                result.over_reserved = max(
                    result.over_reserved, over_reserved(held, reserved_around(before, after))
                )
                result.concurrency.append(
                    sum(1 for x in after.leases if x.service_class.value == "batch")
                )
                result.samples += 1
            time.sleep(0.05)
    result.seconds = time.perf_counter() - t0
    result.extra.update(cpu.stop())
    result.output_tokens = _output_tokens(repo, job)
    failed = repo.stats.counted_states(job).get(ItemState.FAILED, 0)
    result.extra |= {"job": job, "items_leaning_on_prefix": _leaned(repo, job), "failed": failed}
    result.extra.update(_first_seconds(repo, job))
    intervals, (taken, ended) = backfill_intervals(repo, job)
    result.extra["prefix_pass_s"] = [taken, ended]
    result.extra["timeline"] = timeline(intervals, result.seconds).row()
    if share:
        result.extra["prefix_groups"] = [
            {"items": g.items, "blocks": g.blocks} for g in repo.prefixes.prefix_groups(job)
        ]
    return result


async def _straight(url: str, bodies: Sequence[dict[str, Any]], concurrency: int) -> SideResult:
    result = SideResult("client", len(bodies), 0.0, 0)
    t0 = 0.0
    in_flight = 0
    queue = iter(bodies)
    intervals: list[tuple[float, float]] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one_at_a_time(client: httpx.AsyncClient) -> None:
        nonlocal in_flight
        for body in queue:
            in_flight += 1
            result.concurrency.append(in_flight)
            sent = time.perf_counter() - t0
            try:
                answer = await client.post(ENDPOINT, json=body)
            finally:
                in_flight -= 1
                intervals.append((sent, time.perf_counter() - t0))
            answer.raise_for_status()
            result.output_tokens += int(answer.json()["usage"]["completion_tokens"])

    async with httpx.AsyncClient(base_url=url, timeout=SIDE_TIMEOUT_S, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one_at_a_time(client) for _ in range(concurrency)))
        result.seconds = time.perf_counter() - t0
    result.extra["timeline"] = timeline(intervals, result.seconds).row()
    return result


def run_client(
    url: str, w: PrefixWorkload, prompts: Sequence[str], concurrency: int, cpu: CpuWatch
) -> SideResult:
    """The same requests straight to the engine, ``concurrency`` in flight, at the priority
    Backfill's worker sends batch at: the engine's step scheduler treats both sides' requests
    alike (at vLLM's default priority 0 it took the client's for interactive ones)."""
    outputs = output_lengths(len(prompts), w.max_tokens, w.vary_output)
    priority = DispatchConfig(node="bench").batch_priority
    bodies = [
        request_body(w.model, p, n) | {"priority": priority}
        for p, n in zip(prompts, outputs, strict=True)
    ]
    cpu.start()
    result = asyncio.run(_straight(url, bodies, max(1, concurrency)))
    result.extra.update(cpu.stop())
    return result


def run_batch(w: PrefixWorkload, prompts: Sequence[str], workdir: Path) -> SideResult:
    """The same requests through ``vllm run-batch`` (its engine's start not timed)."""
    spec = devengine.MODELS[w.model]
    python, model_dir = devengine.provision(w.model)
    outputs = output_lengths(len(prompts), w.max_tokens, w.vary_output)
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": ENDPOINT,
            "body": request_body(w.model, p, n),
        }
        for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))
    ]
    src, dst = workdir / "in.jsonl", workdir / "out.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = [
        str(python), "-c", RUN_BATCH_DRIVER, "-i", str(src), "-o", str(dst),
        "--model", str(model_dir), "--served-model-name", spec.name, *engine_args(spec),
        "--num-gpu-blocks-override", str(w.kv_blocks),
    ]  # fmt: skip
    proc = subprocess.run(
        argv,
        cwd=workdir,
        env=engine_env(workdir, 1),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        check=False,
    )
    marker = [x for x in proc.stdout.splitlines() if x.startswith("BACKFILL_RUN_BATCH ")]
    if proc.returncode != 0 or not marker:
        tail = "\n".join(proc.stdout.splitlines()[-20:])
        raise RuntimeError(f"vllm run-batch failed (exit {proc.returncode}):\n{tail}")
    rows = [json.loads(x) for x in dst.read_text().splitlines() if x.strip()]
    bad = [r for r in rows if r.get("error") or r["response"]["status_code"] != 200]
    if bad or len(rows) != len(lines):
        raise RuntimeError(f"run-batch: {len(bad)} failed of {len(rows)}: {bad[:1]}")
    seconds = float(json.loads(marker[-1].split(" ", 1)[1])["seconds"])
    out = sum(int(r["response"]["body"]["usage"]["completion_tokens"]) for r in rows)
    return SideResult("run-batch", len(rows), seconds, out)


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument(
        "--model", default=None, help="tiny or smollm2 (default: smollm2; tiny with --quick)"
    )
    p.add_argument("--items", type=int, default=None, help="override the job's items")
    p.add_argument(
        "--vary-output",
        action="store_true",
        help="each item's max_tokens from half to 1.5x the mean, so items end apart",
    )
    p.add_argument("--no-run-batch", action="store_true", help="leave vllm run-batch out")
    p.add_argument("--kv-blocks", type=int, default=None, help="override the engine's KV blocks")
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="the engine's KV block size (the CPU engine's default: 128; a GPU's: 16; the CPU "
        "backend takes multiples of 32); the pool keeps its KV tokens (the blocks scale)",
    )
    args = p.parse_args(argv)
    w = workload(args.quick, args.model)
    if args.items or args.kv_blocks or args.vary_output:
        w = PrefixWorkload(
            **{
                **asdict(w),
                "items": args.items or w.items,
                "kv_blocks": args.kv_blocks or w.kv_blocks,
                "vary_output": args.vary_output,
            }
        )
    started = datetime.now(UTC).isoformat(timespec="seconds")
    logs = OUT_DIR / "prefix-logs"
    logs.mkdir(parents=True, exist_ok=True)
    settings = get_settings()
    blocks, engine_flags = w.kv_blocks, {}
    if args.block_size:
        # The workload's pool is counted in the CPU engine's default blocks of 128 tokens.
        blocks = w.kv_blocks * CPU_BLOCK // args.block_size
        engine_flags["extra_args"] = ("--block-size", str(args.block_size))
    server = devengine.start_model(
        w.model,
        num_gpu_blocks_override=blocks,
        kv_cache_gib=1,
        max_model_len=2048,
        **engine_flags,
    )
    try:
        pool = parse_cache_config(httpx.get(f"{server.url}/metrics", timeout=10).text)
        if not pool.prefix_caching:
            raise RuntimeError("the engine runs without prefix caching: nothing to share")
        shared, prompts = build_prompts(server.url, w)
        shared_tokens = _count(server.url, w.model, shared)
        prompt_tokens = [_count(server.url, w.model, x) for x in prompts]
        say(
            f"{w.model}: pool {pool.capacity_tokens} tokens (block {pool.block_size}); "
            f"instruction {shared_tokens} tokens; prompts {min(prompt_tokens)}-"
            f"{max(prompt_tokens)} tokens; {w.items} items x {w.max_tokens} out"
            + (" (varied from half to 1.5x)" if w.vary_output else "")
        )
        with BackfillStack(server.url, logs, {"reaper_interval_s": "0.5"}).running() as stack:
            ledger = Ledger.from_url(settings.redis_url, stack.namespace, pool_policy(settings))
            repo = Repository.connect(stack.database_url, pool_size=2)
            try:
                cpu = CpuWatch(server.pid, stack.pids)
                whole = run_backfill(stack, repo, ledger, pool, w, prompts, share=False, cpu=cpu)
                say(
                    f"whole: {whole.seconds:.1f} s, peak {whole.peak}, "
                    f"{whole.tokens_per_s:.1f} tok/s"
                )
                shared_run = run_backfill(
                    stack, repo, ledger, pool, w, prompts, share=True, cpu=cpu
                )
                say(
                    f"shared: {shared_run.seconds:.1f} s, peak {shared_run.peak}, "
                    f"{shared_run.tokens_per_s:.1f} tok/s; prefix pass ended at "
                    f"{shared_run.extra['prefix_pass_ended_s']} s, first start at "
                    f"{shared_run.extra['first_start_s']} s"
                )
            finally:
                repo.close()
                ledger.close()
        client = run_client(server.url, w, prompts, shared_run.peak, CpuWatch(server.pid))
        say(f"client c={shared_run.peak}: {client.seconds:.1f} s, {client.tokens_per_s:.1f} tok/s")
    finally:
        server.stop()
    sides = [whole, shared_run, client]
    for s in sides:
        say(
            f"{s.side}: {s.extra.get('timeline')}; prefix pass {s.extra.get('prefix_pass_s')}; "
            f"CPU s: { {k: v for k, v in s.extra.items() if k.endswith('_cpu_s')} }"
        )
    run_batch_error = None
    if not args.no_run_batch:
        try:
            with tempfile.TemporaryDirectory(prefix="bfprefix-rb-") as workdir:
                sides.append(run_batch(w, prompts, Path(workdir)))
            say(f"run-batch: {sides[-1].seconds:.1f} s, {sides[-1].tokens_per_s:.1f} tok/s")
        except RuntimeError as exc:
            run_batch_error = str(exc)
            say(f"run-batch not measured: {exc}")
    v = verdict(shared_run, whole, client)
    print(
        table(
            ["side", "items", "seconds", "out tokens", "out tok/s", "peak seqs", "mean seqs",
             "alloc over reserved"],
            side_rows(sides),
        )
    )  # fmt: skip
    print()
    print(
        table(
            ["figure", "value", "goal", "holds"],
            [(*c[:3], "yes" if c[3] else "no") for c in v.checks],
        )
    )
    print(
        f"{w.model}: instruction {shared_tokens} tokens, prompts {min(prompt_tokens)}-"
        f"{max(prompt_tokens)} (mean {sum(prompt_tokens) / len(prompt_tokens):.0f}), pool "
        f"{pool.capacity_tokens} KV tokens; client at c={shared_run.peak}; "
        f"{shared_run.extra.get('items_leaning_on_prefix')} of {w.items} shared items leaned "
        f"on the prefix; {machine()}"
    )
    details = {
        "command": "python -m bench.prefix"
        + (" --quick" if args.quick else "")
        + (" --vary-output" if args.vary_output else "")
        + (f" --block-size {args.block_size}" if args.block_size else ""),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": started,
        "workload": asdict(w),
        "instruction_tokens": shared_tokens,
        "prompt_tokens": prompt_tokens,
        "pool": {"capacity_tokens": pool.capacity_tokens, "block_size": pool.block_size},
        "sides": {
            s.side: asdict(s) | {"tokens_per_s": s.tokens_per_s, "peak": s.peak, "mean": s.mean}
            for s in sides
        },
        "checks": [list(c) for c in v.checks],
        "run_batch_error": run_batch_error,
    }
    finish(
        NAME,
        "concurrency_ratio",
        v.concurrency_ratio,
        ">=",
        CONCURRENCY_GOAL,
        details,
        holds=v.holds,
    )


if __name__ == "__main__":
    main()
