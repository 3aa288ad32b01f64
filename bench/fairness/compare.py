"""Tenant fairness (issue 17): two tenants on one node, fair share vs plain EDF claims.

Tenant A submits a batch with ``--ratio`` (50) times tenant B's items first; a few seconds
later B submits its batch, same window, same request shape (chat, temperature 0,
``ignore_eos``, fixed ``max_tokens``, a unique tag on every prompt so the prefix cache never
helps). One worker (``backfill api`` + ``backfill worker --beat`` processes, as in
production) feeds one real vLLM CPU engine; the node's batch sequences are capped
(``BACKFILL_MAX_IN_FLIGHT_PER_NODE``) so that B's batch needs many rounds of the node, and
"half the node" means half its throughput.

Run on one engine, in order:

* **B alone** (fair share): B's batch on an idle node; its time is the base for "twice its
  time alone".
* **fair share** (``BACKFILL_FAIR_SHARE=true``, the default): A, then B; measured until B's
  batch is done, then A alone for a while, then A is cancelled.
* **EDF** (``BACKFILL_FAIR_SHARE=false``, the behaviour before issue 17, the peer): the same;
  A's earlier deadline keeps B waiting behind all of A's batch, so the run is cut off after
  the fair run's B time (1.5 times it in a full run), and B's time is reported as "more
  than".

Each item's output tokens are spread evenly over its start-to-finish interval (from
Postgres), and every phase sums the overlap: B's share of the output tokens while both have
work (from B's create until B's last item), A's rate alone after B is done against the node's
rate while both ran (work conserving: A gets the whole node back), and the mean sequences each
tenant held.

This module is the command line and the report; the runs are in :mod:`bench.fairness.run`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, finish, machine, parser, table
from bench.fairness.run import Config, config, fmt, run_stack, say
from devkit import devengine

NAME = "fairness"
SHARE_GOAL = 0.45
TIME_GOAL = 1.2
"""B's time beside A at most this many times twice its time alone."""
ALONE_GOAL = 0.95


def rows(alone: dict[str, Any], fair: dict[str, Any], edf: dict[str, Any]) -> list[list[Any]]:
    out: list[list[Any]] = []
    b_alone = alone["b_seconds"]
    for name, res in (("fair share", fair), ("EDF (peer)", edf)):
        both = res["phase_both"]
        b_time = res["b_seconds"]
        time_text = (
            f"{b_time:.1f}" if b_time is not None else f"> {res['b_seconds_lower_bound']:.1f}"
        )
        ratio = (
            b_time / (2 * b_alone)
            if b_time is not None
            else res["b_seconds_lower_bound"] / (2 * b_alone)
        )
        out.append([
            name,
            fmt(both["b_share"]),
            f"{both['seqs_a']:.1f} / {both['seqs_b']:.1f}",
            time_text,
            ("" if b_time is not None else "> ") + fmt(ratio, 2),
            fmt(res["phase_a_before"]["tokens_per_s"], 0),
            fmt(both["tokens_per_s"], 0),
            fmt(res["phase_a_after"]["tokens_per_s_a"], 0) if res["phase_a_after"] else "-",
            f"{fmt(res['a_alone_seqs_ratio'])} / {fmt(res['a_alone_tokens_ratio'])}",
        ])  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = parser(NAME, __doc__ or "")
    p.add_argument("--model", default="tiny", choices=sorted(devengine.MODELS))
    p.add_argument("--b-items", type=int, default=None, help="tenant B's items")
    p.add_argument("--ratio", type=int, default=None, help="A's items per B item (50)")
    p.add_argument("--in-flight", type=int, default=None, help="node's batch sequence cap")
    args = p.parse_args(argv)
    cfg = config(args.quick, args.model)
    given = {"b_items": args.b_items, "ratio": args.ratio, "in_flight": args.in_flight}
    changes = {k: v for k, v in given.items() if v is not None}
    cfg = Config(**{**asdict(cfg), **changes})
    logs = OUT_DIR / "fairness-logs"
    logs.mkdir(parents=True, exist_ok=True)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    load_before = _loadavg()
    t0 = time.monotonic()
    server = devengine.start_model(cfg.model, kv_cache_gib=cfg.kv_cache_gib)
    try:
        say(f"engine up in {server.ready_seconds:.0f} s; {cfg}")
        alone, fair = run_stack(server, cfg, logs, fair=True, b_timeout_s=0)
        assert alone is not None
        cap = cfg.peer_cap * (fair["b_seconds"] or fair["b_seconds_lower_bound"])
        _, edf = run_stack(server, cfg, logs, fair=False, b_timeout_s=cap)
    finally:
        server.stop()
    elapsed = time.monotonic() - t0
    load_after = _loadavg()
    print(
        f"model {cfg.model}; A {cfg.b_items * cfg.ratio} items, B {cfg.b_items} items, "
        f"{cfg.max_tokens} output tokens each; node capped at {cfg.in_flight} batch sequences; "
        "B alone "
        + " and ".join(
            f"{r['b_seconds']:.1f} s ({r['phase']['tokens_per_s']:.0f} tok/s)"
            for r in alone["runs"]
        )
        + " (before and after)"
    )
    print(
        table(
            ["claims", "B share (both)", "seqs A / B", "B s", "B / 2x alone",
             "tok/s A before", "tok/s both", "tok/s A after", "A after / both: seqs / tok"],
            rows(alone, fair, edf),
        )
    )  # fmt: skip
    b_share = fair["phase_both"]["b_share"]
    peer_share = edf["phase_both"]["b_share"]
    b_ratio = fair["b_seconds"] / (2 * alone["b_seconds"]) if fair["b_seconds"] else None
    # The same, had the node made as many tokens per second beside A as it did for B alone
    # (the machine's other load moves the node's rate between phases).
    both_tps = fair["phase_both"]["tokens_per_s"]
    b_ratio_same_rate = (
        b_ratio * both_tps / alone["tokens_per_s"] if b_ratio and alone["tokens_per_s"] else None
    )
    # A alone after B, against a lone tenant on the node with plain EDF claims (the EDF run,
    # where B never got a sequence): what fair share costs a tenant that has the node alone.
    edf_seqs = edf["phase_both"]["seqs_a"] + edf["phase_both"]["seqs_b"]
    after = fair["phase_a_after"]
    a_vs_edf = after["seqs_a"] / edf_seqs if after and edf_seqs else None
    print(
        f"B share fair / EDF: {b_share:.3f} / {peer_share:.3f}"
        + (f" (x{b_share / peer_share:.1f})" if peer_share > 0 else " (EDF gave B nothing)")
        + f"; B time / twice alone: {fmt(b_ratio, 2)} (goal <= {TIME_GOAL}; "
        f"{fmt(b_ratio_same_rate, 2)} at the node's rate alone); "
        f"A alone after B / both: sequences {fmt(fair['a_alone_seqs_ratio'])}, tokens/s "
        f"{fmt(fair['a_alone_tokens_ratio'])} (goal >= {ALONE_GOAL}); A alone, fair / EDF: "
        f"sequences {fmt(a_vs_edf)}"
    )
    cpu_rows = []
    for name, ph in (
        ("B alone", alone["phase"]),
        ("fair: both", fair["phase_both"]),
        ("fair: A after", fair["phase_a_after"]),
        ("EDF: both", edf["phase_both"]),
    ):
        if not ph or "cpu_per_s" not in ph:
            continue
        cpu = ph["cpu_per_s"]
        engine = cpu.get("engine", 0.0) + cpu.get("vllm_api", 0.0)
        cpu_rows.append([
            name, ph["tokens_per_s"], cpu.get("engine", 0.0), cpu.get("vllm_api", 0.0),
            cpu.get("bf_worker", 0.0), cpu.get("bf_api", 0.0),
            ph["tokens_per_s"] / engine if engine else 0.0,
        ])  # fmt: skip
    print(
        table(
            ["phase", "tok/s", "engine CPU/s", "vLLM API CPU/s", "worker CPU/s", "API CPU/s",
             "tok per engine CPU-s"],
            cpu_rows,
        )
    )  # fmt: skip
    print(
        f"load average before / after: {load_before} / {load_after}; {machine()}; "
        f"{elapsed:.0f} s in all"
    )
    details = {
        "command": "python -m bench.fairness" + (" --quick" if args.quick else ""),
        "argv": sys.argv[1:] if argv is None else list(argv),
        "started": started,
        "config": asdict(cfg),
        "load_before": load_before,
        "load_after": load_after,
        "b_alone": alone,
        "fair": fair,
        "edf": edf,
        "b_share_peer": peer_share,
        "b_time_over_twice_alone": b_ratio,
        "b_time_over_twice_alone_same_rate": b_ratio_same_rate,
        "b_time_ok": b_ratio is not None and b_ratio <= TIME_GOAL,
        "a_alone_ok": (fair["a_alone_seqs_ratio"] or 0) >= ALONE_GOAL,
        "a_alone_seqs_over_edf": a_vs_edf,
        "seconds": elapsed,
    }
    finish(NAME, "b_share", b_share, ">=", SHARE_GOAL, details)


def _loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


if __name__ == "__main__":
    main()
