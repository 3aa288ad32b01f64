"""The fairness benchmark's runs on one Backfill stack: tenants A and B, what their items did
(from Postgres, as output-token intervals summed over each phase), and the three runs (B
alone, A and B with fair share, A and B with plain EDF claims).
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

from backfill.config import libpq_url
from backfill.engine_metrics import parse_engine_load
from backfill.store import Repository
from bench.stack import BackfillStack
from bench.throughput.engine import cpu_seconds
from bench.throughput.workload import Workload, request_lines
from devkit import devengine

WINDOW = "24h"


@dataclass(frozen=True)
class Config:
    model: str
    b_items: int
    ratio: int
    max_tokens: int
    prompt_chars: int
    in_flight: int
    head_start_s: float
    """A runs alone this long before B submits."""
    a_alone_s: float
    """A runs alone this long after B's batch is done."""
    peer_cap: float
    """The EDF run stops at this many times the fair run's B time (B still waiting)."""
    kv_cache_gib: int = 1


def config(quick: bool, model: str) -> Config:
    if quick:
        return Config(model, b_items=96, ratio=50, max_tokens=64, prompt_chars=60,
                      in_flight=8, head_start_s=6, a_alone_s=10, peer_cap=1.0)  # fmt: skip
    return Config(model, b_items=240, ratio=50, max_tokens=64, prompt_chars=60,
                  in_flight=8, head_start_s=10, a_alone_s=20, peer_cap=1.5)  # fmt: skip


def say(message: str) -> None:
    print(f"[fairness] {message}", file=sys.stderr, flush=True)


@dataclass
class Tenant:
    name: str
    key: str


@dataclass
class Interval:
    tenant: str
    start: float
    end: float
    tokens: int


class Run:
    """Tenants A and B on one running stack, and what their items did (from Postgres)."""

    def __init__(self, stack: BackfillStack, cfg: Config, served: str) -> None:
        self.stack = stack
        self.cfg = cfg
        self.served = served
        repo = Repository.connect(stack.database_url, pool_size=1)
        try:
            self.tenants = {
                n: Tenant(
                    n, repo.tenants.create_api_key(repo.tenants.create_tenant(f"tenant-{n}").id)
                )
                for n in ("a", "b")
            }
        finally:
            repo.close()
        self.jobs: dict[str, str] = {}
        self.created: dict[str, float] = {}
        self.engine_pid = 0
        self.cpu_marks: dict[str, tuple[float, dict[str, float]]] = {}

    def mark(self, name: str) -> None:
        """CPU seconds so far of the engine (vLLM's API server and its engine processes) and
        of Backfill's API and worker, at this moment."""
        self.cpu_marks[name] = (time.time(), cpu_seconds(self.engine_pid, self.stack.pids))

    def cpu_between(self, first: str, last: str) -> dict[str, float]:
        """CPU seconds per wall second of each process between two marks."""
        (t0, c0), (t1, c1) = self.cpu_marks[first], self.cpu_marks[last]
        span = max(t1 - t0, 1e-9)
        return {k: round((c1[k] - c0.get(k, 0.0)) / span, 3) for k in c1}

    def submit(self, tenant: str, n: int) -> str:
        w = Workload(self.cfg.model, n, self.cfg.prompt_chars, self.cfg.max_tokens, 1, (), 0,
                     self.cfg.kv_cache_gib, 0.0)  # fmt: skip
        lines = request_lines(w, self.served, n, f"{tenant}{secrets.token_hex(3)}")
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        auth = {"Authorization": f"Bearer {self.tenants[tenant].key}"}
        with httpx.Client(base_url=self.stack.base, headers=auth, timeout=120) as client:
            up = client.post("/v1/files", files={"file": ("in.jsonl", data)},
                             data={"purpose": "batch"})  # fmt: skip
            up.raise_for_status()
            t0 = time.time()
            created = client.post(
                "/v1/batches",
                json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions",
                      "completion_window": WINDOW},
            )  # fmt: skip
            created.raise_for_status()
        batch_id = str(created.json()["id"])
        self.jobs[tenant] = batch_id
        self.created[tenant] = t0
        return batch_id

    def done_count(self, tenant: str) -> tuple[int, int]:
        with psycopg.connect(libpq_url(self.stack.database_url)) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE state = 'succeeded'), "
                "count(*) FILTER (WHERE state IN ('failed', 'expired', 'cancelled')) "
                "FROM items WHERE job_id = %s",
                (self.jobs[tenant],),
            ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    def wait_done(self, tenant: str, n: int, timeout_s: float) -> float | None:
        """Seconds from the tenant's create to its last item, or None if not done in time."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            ok, bad = self.done_count(tenant)
            if bad:
                raise RuntimeError(f"tenant {tenant}: {bad} items ended badly; logs in "
                                   f"{self.stack.logs}")  # fmt: skip
            if ok >= n:
                return self.last_finish(tenant) - self.created[tenant]
            time.sleep(0.25)
        return None

    def last_finish(self, tenant: str) -> float:
        with psycopg.connect(libpq_url(self.stack.database_url)) as conn:
            row = conn.execute(
                "SELECT extract(epoch FROM max(finished_at)) FROM items WHERE job_id = %s",
                (self.jobs[tenant],),
            ).fetchone()
        assert row is not None
        assert row[0] is not None
        return float(row[0])

    def cancel(self, tenant: str) -> None:
        auth = {"Authorization": f"Bearer {self.tenants[tenant].key}"}
        with httpx.Client(base_url=self.stack.base, headers=auth, timeout=60) as client:
            client.post(f"/v1/batches/{self.jobs[tenant]}/cancel").raise_for_status()

    def intervals(self) -> list[Interval]:
        """Every item that ran: its tenant, start, end (now for one still running), and
        output tokens (what it has streamed so far for one still running)."""
        tenant_of = {job: t for t, job in self.jobs.items()}
        with psycopg.connect(libpq_url(self.stack.database_url)) as conn:
            rows = conn.execute(
                "SELECT job_id, extract(epoch FROM started_at), "
                "extract(epoch FROM coalesce(finished_at, now())), "
                "coalesce(output_tokens, partial_tokens, 0) FROM items "
                "WHERE started_at IS NOT NULL AND job_id = ANY(%s)",
                (list(tenant_of),),
            ).fetchall()
        return [Interval(tenant_of[r[0]], float(r[1]), float(r[2]), int(r[3])) for r in rows]


def phase(intervals: Sequence[Interval], start: float, end: float) -> dict[str, Any]:
    """Output tokens and mean sequences per tenant in [start, end), each item's tokens spread
    evenly over its interval."""
    span = max(end - start, 1e-9)
    tokens = {"a": 0.0, "b": 0.0}
    seqs = {"a": 0.0, "b": 0.0}
    for iv in intervals:
        overlap = min(iv.end, end) - max(iv.start, start)
        if overlap <= 0:
            continue
        length = max(iv.end - iv.start, 1e-9)
        tokens[iv.tenant] += iv.tokens * overlap / length
        seqs[iv.tenant] += overlap / span
    total = tokens["a"] + tokens["b"]
    return {
        "seconds": span,
        "tokens_a": tokens["a"],
        "tokens_b": tokens["b"],
        "tokens_per_s": total / span,
        "tokens_per_s_a": tokens["a"] / span,
        "b_share": tokens["b"] / total if total else 0.0,
        "seqs_a": seqs["a"],
        "seqs_b": seqs["b"],
    }


def wait_engine_idle(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            load = parse_engine_load(httpx.get(f"{url}/metrics", timeout=5).text)
            if load.num_requests_running == 0 and load.num_requests_waiting == 0:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    say("engine still busy after the wait; going on")


def overrides(cfg: Config, fair: bool) -> dict[str, str]:
    return {
        "fair_share": "true" if fair else "false",
        "max_in_flight_per_node": str(cfg.in_flight),
    }


def b_alone(run: Run, server: devengine.EngineServer) -> dict[str, Any]:
    """B's batch on the idle node: the base of "twice its time alone"."""
    cfg = run.cfg
    wait_engine_idle(server.url)
    time.sleep(2)  # a cancelled batch's items settle on the next maintenance tick
    run.mark("alone_start")
    run.submit("b", cfg.b_items)
    seconds = run.wait_done("b", cfg.b_items, 900)
    run.mark("alone_end")
    if seconds is None:
        raise RuntimeError("B alone did not finish in 15 minutes")
    alone = phase(run.intervals(), run.created["b"], run.created["b"] + seconds)
    alone["cpu_per_s"] = run.cpu_between("alone_start", "alone_end")
    wait_engine_idle(server.url)
    say(f"B alone: {seconds:.1f} s, {alone['tokens_per_s']:.0f} tok/s, CPU/s {alone['cpu_per_s']}")
    return {"b_seconds": seconds, "phase": alone}


def mixed(
    run: Run, server: devengine.EngineServer, *, fair: bool, b_timeout_s: float
) -> dict[str, Any]:
    """A first, B a head start later; until B is done (or the timeout), then A alone."""
    cfg = run.cfg
    a_items = cfg.b_items * cfg.ratio
    run.submit("a", a_items)
    time.sleep(cfg.head_start_s)
    run.mark("both_start")
    run.submit("b", cfg.b_items)
    b_seconds = run.wait_done("b", cfg.b_items, b_timeout_s)
    run.mark("both_end")
    both_end = run.created["b"] + b_seconds if b_seconds is not None else time.time()
    if b_seconds is not None:
        time.sleep(cfg.a_alone_s)
    run.mark("after_end")
    after_end = time.time()
    ivs = run.intervals()
    a_done, _ = run.done_count("a")
    run.cancel("a")
    if b_seconds is None:
        run.cancel("b")
    b_done, _ = run.done_count("b")
    before = phase(ivs, run.created["a"] + cfg.head_start_s / 2, run.created["b"])
    both = phase(ivs, run.created["b"], both_end)
    after = phase(ivs, both_end, after_end) if b_seconds is not None else None
    both["cpu_per_s"] = run.cpu_between("both_start", "both_end")
    if after is not None:
        after["cpu_per_s"] = run.cpu_between("both_end", "after_end")
    node_seqs = both["seqs_a"] + both["seqs_b"]
    result: dict[str, Any] = {
        "fair_share": fair,
        "a_items": a_items,
        "a_items_done": a_done,
        "b_items_done": b_done,
        "b_seconds": b_seconds,
        "b_seconds_lower_bound": both_end - run.created["b"],
        "phase_a_before": before,
        "phase_both": both,
        "phase_a_after": after,
        # Work conserving: A alone holds what the node held for both (sequences), and makes
        # the tokens both made (the token rate also moves with the machine's other load).
        "a_alone_seqs_ratio": after["seqs_a"] / node_seqs if after and node_seqs else None,
        "a_alone_tokens_ratio": (
            after["tokens_per_s_a"] / both["tokens_per_s"]
            if after and both["tokens_per_s"]
            else None
        ),
    }
    b_text = f"{b_seconds:.1f} s" if b_seconds is not None else "not done"
    say(
        f"{'fair' if fair else 'edf'}: B {b_text}, B share {both['b_share']:.3f}, "
        f"A alone after / both: seqs {fmt(result['a_alone_seqs_ratio'])}, "
        f"tokens {fmt(result['a_alone_tokens_ratio'])}"
    )
    return result


def run_stack(
    server: devengine.EngineServer, cfg: Config, logs: Path, *, fair: bool, b_timeout_s: float
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """With fair share: B alone, then A and B; without: A and B only."""
    label = "fair" if fair else "edf"
    with BackfillStack(server.url, logs / label, overrides(cfg, fair)).running() as stack:
        run = Run(stack, cfg, server.served_model_name)
        run.engine_pid = server.pid
        if not fair:
            result = mixed(run, server, fair=fair, b_timeout_s=b_timeout_s)
            alone = None
        else:
            # B alone just before and just after, so a change in the machine's other load
            # over the run moves both sides of "twice its time alone".
            first = b_alone(run, server)
            result = mixed(run, server, fair=fair, b_timeout_s=max(120.0, 20 * first["b_seconds"]))
            second = b_alone(run, server)
            runs = [first, second]
            alone = {
                "b_seconds": sum(r["b_seconds"] for r in runs) / 2,
                "tokens_per_s": sum(r["phase"]["tokens_per_s"] for r in runs) / 2,
                "runs": runs,
                "phase": first["phase"],
            }
    wait_engine_idle(server.url)
    return alone, result


def fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"
