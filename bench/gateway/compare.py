"""Latency Backfill's interactive admission adds, and a plain reverse proxy's beside it: time
to first token and time between tokens through the central gateway (the API process), through
the engine gate (the same admission inside vLLM's own API server, ``queue_api.engine_gate``),
through nginx, and straight to the same vLLM server, in one run.

One tiny-model vLLM server with the engine gate (``--middleware``) and its own key, one API
process (``backfill api``, its own process as in production) over a scratch database and
ledger namespace, one registered node, and nginx (Debian's package; ``bench.gateway.nginx``)
proxying to the same server. Requests are sent one at a time in rounds of the four sides (the
order rotates every round), each with a unique prompt of the same length (no prefix-cache
hits), streaming, 32 output tokens: a tenant's key to the gateway and to the engine gate, the
engine's key to nginx and direct (which the gate passes on after one header compare, so
direct pays that too). TTFT is from sending the request to the first chunk that carries text;
ITL is a request's mean time between its chunks after the first. The figures are the medians
of the per-round differences against direct; the closing figure is the engine gate's against
nginx's (the gateway's is in the table and the record). With ``--pin`` the engine runs on the
last core and everything else (API, nginx, this client) on the others, as a GPU node has them
apart; without it all share the machine's cores. Each admission's own account of where its
time goes comes from its ``backfill_gateway_hop_seconds`` histogram (medians per hop; the
gate's from the engine's ``/metrics``).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from prometheus_client.parser import text_string_to_metric_families

from backfill.config import Settings, get_settings
from backfill.engine.http import sse_lines_blocking
from backfill.engine_metrics import parse_cache_config
from backfill.ledger import Ledger, NodePool
from backfill.maintenance import pool_policy
from backfill.store import Repository
from bench.common import finish, parser, percentile, scratch_database, served, table
from bench.gateway.nginx import nginx_proxy
from devkit import devengine

NAME = "gateway"
GOAL_RATIO = 1.5
"""Backfill's added TTFT p50 at most this many times nginx's."""
NODE = "bench0"
OUTPUT_TOKENS = 32
WORDS = "the quick brown fox jumps over the lazy dog while the cat sleeps " * 3
SIDES = ("gateway", "engine-gate", "nginx", "direct")
TENANT_SIDES = ("gateway", "engine-gate")
"""Sides a tenant's key is sent to (the others get the engine's own)."""
HOPS = (
    "edge",
    "parse",
    "reserve",
    "engine_headers",
    "engine_first_chunk",
    "first_chunk_out",
    "chunk_out",
)


def _prompt(i: int, path: str) -> str:
    return f"{i:05d}{path} {WORDS}"


@dataclass(frozen=True)
class Stream:
    ttft_s: float
    itl_s: float
    """Mean time between chunks after the first."""


def stream(client: httpx.Client, url: str, body: dict[str, Any], headers: dict[str, str]) -> Stream:
    started = time.perf_counter()
    times: list[float] = []
    with client.stream("POST", url, json=body, headers=headers) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:300]}")
        for line in sse_lines_blocking(response):
            if not line.startswith("data:") or "[DONE]" in line:
                continue
            choices = json.loads(line[5:]).get("choices") or ()
            if any(c.get("text") for c in choices):
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError(f"{url} streamed no text")
    itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
    return Stream(times[0] - started, itl)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` and of its descendants on ``cpus``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with suppress(OSError):
            os.sched_setaffinity(int(task), cpus)
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            children = []
        for child in children:
            pin(child, cpus)


@contextmanager
def api_process(
    env: dict[str, str], port: int, log: Path, prefix: Sequence[str] = ()
) -> Iterator[str]:
    url = f"http://127.0.0.1:{port}"
    argv = [*prefix, sys.executable, "-m", "backfill_cli", "api", "--port", str(port)]
    with served("the API", argv, f"{url}/healthz", log, env=env):
        yield url


def _hops(api_url: str) -> dict[str, dict[float, float]]:
    """The gateway's hop account so far: hop -> {bucket's upper bound: observations at most
    that} (``backfill_gateway_hop_seconds``)."""
    text = httpx.get(f"{api_url}/metrics", timeout=10).text
    hops: dict[str, dict[float, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "backfill_gateway_hop_seconds_bucket":
                hops.setdefault(s.labels["hop"], {})[float(s.labels["le"])] = s.value
    return hops


def hop_medians_ms(
    before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
) -> dict[str, float]:
    """Each hop's median over the run, interpolated inside its histogram bucket."""
    medians: dict[str, float] = {}
    for hop, buckets in after.items():
        seen = {le: n - before.get(hop, {}).get(le, 0.0) for le, n in buckets.items()}
        total = seen.get(float("inf"), 0.0)
        if total <= 0:
            continue
        low, below = 0.0, 0.0
        for le in sorted(seen):
            if seen[le] >= total / 2:
                if le == float("inf"):
                    medians[hop] = low * 1000
                else:
                    share = (total / 2 - below) / max(seen[le] - below, 1e-9)
                    medians[hop] = (low + share * (le - low)) * 1000
                break
            low, below = le, seen[le]
    return medians


def main() -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--pin", action="store_true", help="the engine on its own core, apart")
    p.add_argument("--no-nginx", action="store_true", help="leave the nginx side out")
    args = p.parse_args()
    rounds = 60 if args.quick else 300
    warmup = 10
    cores = sorted(os.sched_getaffinity(0))
    engine_cpus, front_cpus = {cores[-1]}, set(cores[:-1]) or {cores[-1]}
    front = ["taskset", "-c", ",".join(map(str, sorted(front_cpus)))] if args.pin else []
    if args.pin:
        os.sched_setaffinity(0, front_cpus)
    settings = get_settings()
    namespace = f"bfbench{secrets.token_hex(4)}"
    engine_key = f"bench-engine-{secrets.token_hex(8)}"
    client = redis.Redis.from_url(settings.redis_url)
    with scratch_database("bfbench_gw") as db_url:
        stores = {
            "BACKFILL_DATABASE_URL": db_url,
            "BACKFILL_REDIS_URL": settings.redis_url,
            "BACKFILL_REDIS_NAMESPACE": namespace,
            "BACKFILL_RATE_LIMIT_PER_S": "100000",
            "BACKFILL_RATE_LIMIT_BURST": "100000",
            "BACKFILL_ENGINE_API_KEY": engine_key,
        }
        server = devengine.start_model(
            "tiny",
            max_model_len=2048,
            kv_cache_gib=1,
            api_key=engine_key,
            gate_settings={**stores, "BACKFILL_GATE_NODE": NODE},
        )
        repo = Repository.connect(db_url, pool_size=2)
        ledger = Ledger(client, namespace, pool_policy(settings))
        try:
            if args.pin:
                pin(server.process.pid, engine_cpus)
            tenant_key = _register(server, repo, ledger, settings)
            proxy = (
                nullcontext(None)
                if args.no_nginx
                else nginx_proxy(server.url, devengine.free_port(), front)
            )
            with (
                tempfile.TemporaryDirectory(prefix="bench-gateway-") as logs,
                api_process(
                    {**os.environ, **stores},
                    devengine.free_port(),
                    Path(logs) / "api.log",
                    front,
                ) as api_url,
                proxy as nginx,
            ):
                urls = {
                    "gateway": api_url,
                    "engine-gate": server.url,
                    "nginx": nginx[0] if nginx is not None else None,
                    "direct": server.url,
                }
                keys = {side: tenant_key if side in TENANT_SIDES else engine_key for side in SIDES}
                results = _run(
                    urls, model=server.served_model_name, keys=keys, rounds=rounds, warmup=warmup
                )
        finally:
            server.stop()
            for k in client.scan_iter(match=f"{namespace}:*", count=1000):
                client.delete(k)
            ledger.close()
            repo.close()
    _report(results, rounds, pinned=args.pin)


def _register(
    server: devengine.EngineServer, repo: Repository, ledger: Ledger, settings: Settings
) -> str:
    """The engine's node in the store and the ledger (as its worker would), and a tenant's key."""
    pool = parse_cache_config(httpx.get(f"{server.url}/metrics", timeout=10).text)
    policy = pool_policy(settings)
    reserve = policy.reserve_tokens(pool.capacity_tokens)
    model = server.served_model_name
    repo.nodes.upsert_node(NODE, server.url, model, pool.num_blocks, pool.block_size, reserve)
    ledger.rebuild(
        [NodePool(NODE, pool.capacity_tokens, pool.block_size, reserve)],
        [],
        repo.recovery.next_ledger_epoch(),
    )
    return repo.tenants.create_api_key(repo.tenants.create_tenant("bench").id)


def _run(
    urls: dict[str, str | None], *, model: str, keys: dict[str, str], rounds: int, warmup: int
) -> dict[str, Any]:
    sides = [side for side in SIDES if urls[side] is not None]
    got: dict[str, list[Stream]] = {side: [] for side in sides}
    clients = {side: httpx.Client(timeout=60) for side in sides}
    admissions = {"gateway": str(urls["gateway"]), "engine-gate": str(urls["engine-gate"])}
    try:

        def one(side: str, i: int) -> Stream:
            body: dict[str, Any] = {
                "model": model,
                "prompt": _prompt(i, side[0] if side != "engine-gate" else "e"),
                "max_tokens": OUTPUT_TOKENS,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
            if side not in TENANT_SIDES:
                body["priority"] = 0
            auth = {"Authorization": f"Bearer {keys[side]}"}
            return stream(clients[side], f"{urls[side]}/v1/completions", body, auth)

        for i in range(warmup):
            for side in sides:
                one(side, -1 - i)
        hops0 = {side: _hops(url) for side, url in admissions.items()}
        for i in range(rounds):
            order = sides[i % len(sides) :] + sides[: i % len(sides)]
            for side in order:
                got[side].append(one(side, i))
        hops1 = {side: _hops(url) for side, url in admissions.items()}
    finally:
        for c in clients.values():
            c.close()
    return {
        "streams": got,
        "hop_p50_ms": {side: hop_medians_ms(hops0[side], hops1[side]) for side in admissions},
    }


def _report(results: dict[str, Any], rounds: int, *, pinned: bool) -> None:
    got: dict[str, list[Stream]] = results["streams"]
    direct = got["direct"]
    rows = []
    details: dict[str, Any] = {"rounds": rounds, "pinned": pinned, "output_tokens": OUTPUT_TOKENS}
    added: dict[str, dict[str, float]] = {}
    for side, streams in got.items():
        ttft = [s.ttft_s * 1000 for s in streams]
        itl = [s.itl_s * 1000 for s in streams]
        rows.append((f"{side}: TTFT", len(ttft), percentile(ttft, 50), percentile(ttft, 99)))
        rows.append((f"{side}: ITL", len(itl), percentile(itl, 50), percentile(itl, 99)))
        if side == "direct":
            continue
        d_ttft = [(s.ttft_s - d.ttft_s) * 1000 for s, d in zip(streams, direct, strict=True)]
        d_itl = [(s.itl_s - d.itl_s) * 1000 for s, d in zip(streams, direct, strict=True)]
        rows.append(
            (f"{side}: added TTFT", len(d_ttft), percentile(d_ttft, 50), percentile(d_ttft, 99))
        )
        rows.append(
            (f"{side}: added ITL", len(d_itl), percentile(d_itl, 50), percentile(d_itl, 99))
        )
        added[side] = {
            "ttft_p50_ms": percentile(d_ttft, 50),
            "ttft_p99_ms": percentile(d_ttft, 99),
            "itl_p50_ms": percentile(d_itl, 50),
            "itl_p99_ms": percentile(d_itl, 99),
        }
        details[f"{side}_ttft_p50_ms"] = percentile(ttft, 50)
        details[f"{side}_itl_p50_ms"] = percentile(itl, 50)
    details["direct_ttft_p50_ms"] = percentile([s.ttft_s * 1000 for s in direct], 50)
    details["added"] = added
    details["hop_p50_ms"] = results["hop_p50_ms"]
    print(table(["path", "requests", "p50 ms", "p99 ms"], rows))
    for side, hops in results["hop_p50_ms"].items():
        print(
            f"{side}'s own account, p50 ms per hop: "
            + ", ".join(f"{hop} {hops[hop]:.3f}" for hop in HOPS if hop in hops)
        )
    gate = added["engine-gate"]
    if "nginx" not in added:
        finish(NAME, "gate_added_ttft_p50_ms", gate["ttft_p50_ms"], "<=", 1.0, details)
        return
    ng = added["nginx"]
    # A ratio over a sub-millisecond denominator: nginx's added time is floored at 0.1 ms.
    floor = max(ng["ttft_p50_ms"], 0.1)
    details["gateway_added_ttft_p50_vs_nginx"] = added["gateway"]["ttft_p50_ms"] / floor
    details["gate_itl_p50_over_nginx_ms"] = gate["itl_p50_ms"] - ng["itl_p50_ms"]
    details["gateway_itl_p50_over_nginx_ms"] = added["gateway"]["itl_p50_ms"] - ng["itl_p50_ms"]
    print(
        f"against nginx's added TTFT p50 ({ng['ttft_p50_ms']:.3f} ms): engine gate "
        f"{gate['ttft_p50_ms'] / floor:.2f}x, gateway "
        f"{details['gateway_added_ttft_p50_vs_nginx']:.2f}x"
    )
    finish(
        NAME, "gate_added_ttft_p50_vs_nginx", gate["ttft_p50_ms"] / floor, "<=", GOAL_RATIO, details
    )


if __name__ == "__main__":
    main()
