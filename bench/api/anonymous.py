"""What an anonymous caller can make the API spend: the capacity lab's largest traces, and
what six of them at once do to a tenant's keyed calls.

The server is ``backfill api`` in its own process, with the per-address rate limit lifted (the
limit would hide the cost measured here). Figures: the server's CPU seconds per largest lab
request (from /proc: what the request costs whatever else the machine runs) and their wall
time, alone; and ``GET /v1/batches`` latency alone and while six clients loop on those
requests. Figure of the goal: the server's CPU seconds per largest lab request.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from functools import partial
from pathlib import Path

import httpx

from bench.api.server import PYTHON_CLI, bench_key, start_api, stop_api
from bench.common import beside_load, finish, parser, percentile, scratch_database, table

NAME = "anonymous"
GOAL_S = 0.5
LARGEST = [
    # The limits' corners: the most steps, slots, queue and preemptions the lab allows.
    {"capacity_slots": 64, "working_set": 256, "requests": 4096, "interactive_every": 1,
     "reserve_slots": 8, "prompt_tokens": 0, "output_tokens": 4, "max_preemptions": 100},
    {"capacity_slots": 64, "working_set": 64, "requests": 4096, "prompt_tokens": 0,
     "output_tokens": 1, "max_preemptions": 100},
    {"capacity_slots": 1, "working_set": 256, "requests": 4096, "prompt_tokens": 0,
     "output_tokens": 4, "max_preemptions": 100},
    {"capacity_slots": 64, "working_set": 256, "requests": 4096, "interactive_every": 3,
     "reserve_slots": 8},
]  # fmt: skip


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _keyed_latencies(base: str, key: str, reads: int) -> list[float]:
    out = []
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {key}"}) as h:
        for _ in range(reads):
            t0 = time.perf_counter()
            h.get("/v1/batches", timeout=60).raise_for_status()
            out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    args = parser(NAME, __doc__ or "").parse_args()
    rounds = 2 if args.quick else 5
    reads = 50 if args.quick else 200
    namespace = f"bfbench{secrets.token_hex(3)}"
    with scratch_database("bfanon") as url:
        key = bench_key(url)
        port = 22_000 + secrets.randbelow(2000)
        process = start_api(
            url,
            namespace,
            port,
            {
                "BACKFILL_ANONYMOUS_RATE_LIMIT_PER_S": "100000",
                "BACKFILL_ANONYMOUS_RATE_LIMIT_BURST": "100000",
            },
            command=PYTHON_CLI,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            lab: list[float] = []
            cpu_before = _cpu_s(process.pid)
            with httpx.Client(base_url=base, timeout=120) as h:
                for _ in range(rounds):
                    for params in LARGEST:
                        t0 = time.perf_counter()
                        h.post("/lab/kv", json=params).raise_for_status()
                        lab.append(time.perf_counter() - t0)
            cpu_per_call = (_cpu_s(process.pid) - cpu_before) / len(lab)
            _keyed_latencies(base, key, 20)  # warm the key cache and connections
            alone = _keyed_latencies(base, key, reads)

            def hammer(params: dict[str, int], stop: threading.Event) -> None:
                with httpx.Client(base_url=base, timeout=300) as h:
                    while not stop.is_set():
                        h.post("/lab/kv", json=params)

            loaded = beside_load(
                [partial(hammer, LARGEST[i % len(LARGEST)]) for i in range(6)],
                partial(_keyed_latencies, base, key, reads),
                join_s=120,
            )
        finally:
            stop_api(process, namespace)

    slowest = max(lab)
    rows = [
        ("largest lab request, server CPU per call (s)", cpu_per_call),
        (f"largest lab request, slowest of {len(lab)} (s)", slowest),
        ("largest lab request, p50 (s)", percentile(lab, 50)),
        ("GET /v1/batches alone, p50 (s)", percentile(alone, 50)),
        ("GET /v1/batches alone, p99 (s)", percentile(alone, 99)),
        ("GET /v1/batches beside 6 lab loops, p50 (s)", percentile(loaded, 50)),
        ("GET /v1/batches beside 6 lab loops, p99 (s)", percentile(loaded, 99)),
    ]
    print(table(["measure", "value"], rows))
    finish(
        NAME,
        "lab_cpu_s_per_call",
        cpu_per_call,
        "<=",
        GOAL_S,
        {
            "quick": args.quick,
            "slowest_lab_s": slowest,
            "lab_s": lab,
            "keyed_alone_p50_s": percentile(alone, 50),
            "keyed_alone_p99_s": percentile(alone, 99),
            "keyed_loaded_p50_s": percentile(loaded, 50),
            "keyed_loaded_p99_s": percentile(loaded, 99),
        },
    )


if __name__ == "__main__":
    main()
