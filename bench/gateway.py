"""Latency the interactive gateway adds: time to first token through the gateway vs straight
to the same vLLM server.

One tiny-model vLLM server, one API process (``backfill api``, its own process as in
production) over a scratch database and ledger namespace, one registered node. Requests are
sent one at a time, alternating gateway and direct (the order flips every pair), each with a
unique prompt of the same length (no prefix-cache hits for either path), streaming, 8 output
tokens. TTFT is from sending the request to the first chunk that carries text. The figure is
the median of the per-pair difference; the gateway's own account of its work (parse,
authenticate, count the prompt on the engine, reserve) comes from its
``backfill_gateway_overhead_seconds`` metric.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from backfill.capacity import parse_cache_config
from backfill.config import get_settings
from backfill.ledger import Ledger, NodePool
from backfill.maintenance import pool_policy
from backfill.store import Repository
from bench.common import finish, parser, percentile, scratch_database, table
from worker import devengine

NAME = "gateway"
GOAL_P50_MS = 2.0
NODE = "bench0"
WORDS = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 3


def _prompt(i: int, path: str) -> str:
    return f"{i:05d}{path} {WORDS}"


def ttft_s(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]) -> float:
    started = time.perf_counter()
    first: float | None = None
    with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if first is not None or not line.startswith("data:") or "[DONE]" in line:
                continue
            choices = json.loads(line[5:]).get("choices") or ()
            if any(c.get("text") for c in choices):
                first = time.perf_counter()
    if first is None:
        raise RuntimeError(f"{url} streamed no text")
    return first - started


@contextmanager
def api_process(env: dict[str, str], port: int) -> Iterator[str]:
    cmd = [sys.executable, "-m", "backfill_cli", "api", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                raise RuntimeError(f"the API exited: {err[-2000:]}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the API did not start in 60 s")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _overhead(api_url: str) -> tuple[float, float]:
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    total = count = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "backfill_gateway_overhead_seconds_sum":
                total += s.value
            elif s.name == "backfill_gateway_overhead_seconds_count":
                count += s.value
    return total, count


def main() -> None:
    args = parser(NAME, __doc__ or "").parse_args()
    pairs = 60 if args.quick else 300
    warmup = 10
    settings = get_settings()
    namespace = f"bfbench{secrets.token_hex(4)}"
    server = devengine.start_model("tiny", max_model_len=2048, kv_cache_gib=1)
    try:
        pool = parse_cache_config(httpx.get(f"{server.url}/metrics", timeout=10).text)
        model = server.served_model_name
        with scratch_database("bfbench_gw") as db_url:
            repo = Repository.connect(db_url, pool_size=2)
            policy = pool_policy(settings)
            client = redis.Redis.from_url(settings.redis_url)
            ledger = Ledger(client, namespace, policy)
            try:
                reserve = policy.reserve_tokens(pool.capacity_tokens)
                repo.upsert_node(NODE, server.url, model, pool.num_blocks, pool.block_size, reserve)
                ledger.rebuild(
                    [NodePool(NODE, pool.capacity_tokens, pool.block_size, reserve)],
                    [],
                    repo.next_ledger_epoch(),
                )
                key = repo.create_api_key(repo.create_tenant("bench").id)
                env = {
                    **os.environ,
                    "BACKFILL_DATABASE_URL": db_url,
                    "BACKFILL_REDIS_URL": settings.redis_url,
                    "BACKFILL_REDIS_NAMESPACE": namespace,
                    "BACKFILL_RATE_LIMIT_PER_S": "100000",
                    "BACKFILL_RATE_LIMIT_BURST": "100000",
                }
                with api_process(env, devengine.free_port()) as api_url:
                    results = _run(api_url, server.url, model, key, pairs, warmup)
            finally:
                for k in client.scan_iter(match=f"{namespace}:*", count=1000):
                    client.delete(k)
                ledger.close()
                repo.close()
    finally:
        server.stop()
    _report(results, pairs)


def _run(
    api_url: str, engine_url: str, model: str, key: str, pairs: int, warmup: int
) -> dict[str, Any]:
    gateway, direct, added = [], [], []
    auth = {"Authorization": f"Bearer {key}"}
    with httpx.Client(timeout=60) as gw_client, httpx.Client(timeout=60) as engine_client:

        def one(path: str, i: int) -> float:
            body: dict[str, Any] = {
                "model": model,
                "prompt": _prompt(i, path[0]),
                "max_tokens": 8,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            if path == "gateway":
                return ttft_s(gw_client, f"{api_url}/v1/completions", body, auth)
            body["priority"] = 0
            return ttft_s(engine_client, f"{engine_url}/v1/completions", body, {})

        for i in range(warmup):
            one("gateway", -1 - i)
            one("direct", -1 - i)
        overhead_sum0, overhead_n0 = _overhead(api_url)
        for i in range(pairs):
            order = ("gateway", "direct") if i % 2 == 0 else ("direct", "gateway")
            got = {path: one(path, i) for path in order}
            gateway.append(got["gateway"] * 1000)
            direct.append(got["direct"] * 1000)
            added.append((got["gateway"] - got["direct"]) * 1000)
        overhead_sum, overhead_n = _overhead(api_url)
    overhead_ms = (overhead_sum - overhead_sum0) / max(1.0, overhead_n - overhead_n0) * 1000
    return {"gateway": gateway, "direct": direct, "added": added, "overhead_ms": overhead_ms}


def _report(results: dict[str, Any], pairs: int) -> None:
    gateway, direct, added = results["gateway"], results["direct"], results["added"]
    rows = [
        (name, len(v), percentile(v, 50), percentile(v, 90), percentile(v, 99), statistics.mean(v))
        for name, v in (
            ("TTFT straight to vLLM", direct),
            ("TTFT through the gateway", gateway),
            ("added (per pair)", added),
        )
    ]
    print(table(["path", "requests", "p50 ms", "p90 ms", "p99 ms", "mean ms"], rows))
    print(
        f"gateway overhead (its own metric: parse, auth, tokenize, reserve), mean: "
        f"{results['overhead_ms']:.2f} ms"
    )
    p50_added = percentile(added, 50)
    finish(
        NAME,
        "added_ttft_p50_ms",
        p50_added,
        "<=",
        GOAL_P50_MS,
        {
            "pairs": pairs,
            "direct_p50_ms": percentile(direct, 50),
            "direct_p99_ms": percentile(direct, 99),
            "gateway_p50_ms": percentile(gateway, 50),
            "gateway_p99_ms": percentile(gateway, 99),
            "added_p50_ms": p50_added,
            "added_p90_ms": percentile(added, 90),
            "added_p99_ms": percentile(added, 99),
            "p50_difference_ms": percentile(gateway, 50) - percentile(direct, 50),
            "gateway_overhead_mean_ms": results["overhead_ms"],
            "request": "completions, stream, unique prompt ~40 tokens, max_tokens 8",
        },
    )


if __name__ == "__main__":
    main()
