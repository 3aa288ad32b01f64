"""Shared prompt prefixes on the H200 step model (issue 36's second figure): batch throughput
Backfill keeps from slack with and without shared-prefix accounting, at the protection
benchmark's interactive load.

    python -m bench.prefix_sim [--quick] [--pool-shares 1,0.25,0.125,0.0625]

The simulator's ``h200-llama-3.1-8b`` scenario on the step times measured on a real H200
(``calibration/h200-llama-3.1-8b-torch.json``; async scheduling and a 2 ms host gap, as
``bench.gpu_steps`` runs it): the Azure code trace's share of one node (an hour; ``--quick``
ten minutes), and in front of it a summarisation backlog shaped as ``bench.prefix``'s (100
items a second of simulated time, more than any setting finishes): one
1,000-token instruction per job (10 jobs) before documents of 200-600 tokens (mean 400), 200
output tokens each (``ignore_eos``). Backfill's step scheduler (``backfill-step``, the
scenario's knobs) runs the batch; the engine's prefix caching is on (vLLM's default), so the
engine holds a prefix once and skips its prefill either way. The ledger:

``whole``     today: every item reserves ``round_up(prompt + 200)``, its instruction included;
``shared``    issue 36: the instruction's whole blocks reserved once per node while any item
              holding it runs, each item its own blocks; the rest of a group waits for its
              first holder's first token;
``no-cache``  reference: the engine's prefix caching off (each item prefills and holds its
              own instruction), reserving whole.

Each at the scenario's KV pool and at shares of it (``--pool-shares``: an engine whose pool
is smaller, e.g. beside other models or at a lower memory utilisation), where the slack
binds. Per row: batch output tokens/s, *kept* (over batch alone on the same pool, with the
cache, at the engine's sequence limit), *harvest* (over the slack interactive alone leaves:
batch alone x its idle share), the most batch items in flight and their mean over steps,
and interactive TTFT p50/p99 over interactive alone's.

Ends with ``prefix_sim: throughput_ratio=<shared over whole batch tokens/s at the scenario's
own pool> (goal >= 1.5)``: the issue's throughput goal for ``bench.prefix``. The ratio at
each smaller pool is printed above it.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any

from backfill_analysis.simulate import compare
from backfill_analysis.simulate.engine import Engine
from backfill_analysis.simulate.metrics import PolicyResult
from backfill_analysis.simulate.policies import Frontend
from backfill_analysis.simulate.run import simulate
from backfill_analysis.simulate.scenario import Scenario, h200_llama8b
from backfill_analysis.simulate.trace import AZURE_CODE_TRACE, TraceRequest
from backfill_analysis.simulate.workload import BatchItem
from bench.common import finish, machine, parser, table

NAME = "prefix_sim"
GOAL = 1.5
POLICY = "backfill-step"
SETTINGS = ("whole", "shared", "no-cache")
INSTRUCTION_TOKENS = 1000
ITEMS_PER_S = 100
"""The backlog: more than batch alone finishes (~40 items/s of 200 tokens at 256 sequences),
so every setting runs out of time, not of work."""


def prefix_scenario(quick: bool, pool_share: float = 1.0) -> Scenario:
    """``h200-llama-3.1-8b`` on the measured steps, run as ``bench.gpu_steps`` runs it, with
    ``bench.prefix``'s summarisation backlog and ``pool_share`` of its KV pool."""
    sc = h200_llama8b()
    engine = dataclasses.replace(
        sc.engine,
        async_scheduling=True,
        host_gap_s=0.002,
        num_blocks=max(1, int(sc.engine.num_blocks * pool_share)),
    )
    batch = dataclasses.replace(
        sc.batch,
        items=ITEMS_PER_S * int(sc.duration_s),
        prompt_mean=400,
        prompt_min=200,
        prompt_max=600,
        max_output_tokens=200,
        output_exact=True,
        shared_prefix_tokens=INSTRUCTION_TOKENS,
    )
    sc = dataclasses.replace(sc, engine=engine, batch=batch)
    if quick:
        sc = dataclasses.replace(
            sc, duration_s=600.0, batch=dataclasses.replace(sc.batch, items=ITEMS_PER_S * 600)
        )
    return sc


@dataclass(frozen=True)
class Row:
    pool_blocks: int
    setting: str
    batch_tokens_per_s: float
    kept: float
    harvest: float
    most_in_flight: int
    mean_in_flight: float
    p50_x: float
    p99_x: float


def run_setting(
    sc: Scenario, trace: list[TraceRequest], items: list[BatchItem], setting: str
) -> tuple[PolicyResult, int, float]:
    """One ledger setting (:data:`SETTINGS`): its result, the most batch items in flight and
    their mean over the admission rounds and steps."""
    knobs = dataclasses.replace(sc.knobs, prefix_accounting=setting == "shared")
    run = dataclasses.replace(
        sc, engine=dataclasses.replace(sc.engine, prefix_caching=setting != "no-cache")
    )
    seen = [0, 0, 0]  # most, sum, count

    def watch(policy: Frontend, engine: Engine) -> None:
        n = policy.batch_in_flight
        seen[0] = max(seen[0], n)
        seen[1] += n
        seen[2] += 1

    spec = compare._spec(run, trace, items, knobs)
    result = simulate(spec, POLICY, watch)
    return result, seen[0], seen[1] / max(1, seen[2])


def pool_rows(sc: Scenario) -> tuple[list[Row], compare.Baselines]:
    trace, items = compare.workload(sc, str(AZURE_CODE_TRACE), 0)
    base = compare.baselines(sc, trace, items)
    alone, batch_alone = base.interactive_alone, base.batch_alone.batch_tokens_per_s
    rows = []
    for setting in SETTINGS:
        r, most, mean = run_setting(sc, trace, items, setting)
        rows.append(
            Row(
                sc.engine.num_blocks,
                setting,
                r.batch_tokens_per_s,
                r.batch_tokens_per_s / batch_alone if batch_alone else 0.0,
                base.harvest(r),
                most,
                mean,
                r.ttft_p50_s / alone.ttft_p50_s,
                r.ttft_p99_s / alone.ttft_p99_s,
            )
        )
    return rows, base


def ratio(rows: list[Row]) -> float:
    """Shared over whole batch tokens/s."""
    by = {r.setting: r.batch_tokens_per_s for r in rows}
    return by["shared"] / by["whole"] if by["whole"] > 0 else 0.0


def main(argv: list[str] | None = None) -> int:
    p = parser(NAME, __doc__ or "")
    p.add_argument(
        "--pool-shares",
        default="1,0.25,0.125,0.0625",
        help="KV pool sizes as shares of the scenario's, the first the figure's",
    )
    args = p.parse_args(argv)
    shares = [float(x) for x in args.pool_shares.split(",")]
    print(f"machine: {machine()}")
    rows: list[Row] = []
    ratios: dict[float, float] = {}
    details: dict[str, Any] = {"policy": POLICY, "pools": {}}
    for share in shares:
        sc = prefix_scenario(args.quick, share)
        pool, base = pool_rows(sc)
        rows += pool
        ratios[share] = ratio(pool)
        alone = base.interactive_alone
        print(
            f"pool {share:g} x: {sc.engine.num_blocks:,} blocks of {sc.engine.block_size} "
            f"({sc.engine.capacity_tokens:,} tokens); interactive alone TTFT p50/p99 "
            f"{alone.ttft_p50_s * 1000:.1f}/{alone.ttft_p99_s * 1000:.1f} ms, engine busy "
            f"{alone.busy_s / alone.duration_s:.1%}; batch alone "
            f"{base.batch_alone.batch_tokens_per_s:,.0f} tokens/s; slack "
            f"{base.slack_tokens_per_s:,.0f} tokens/s"
        )
        details["pools"][str(share)] = {
            "num_blocks": sc.engine.num_blocks,
            "alone_ttft_p50_s": alone.ttft_p50_s,
            "alone_ttft_p99_s": alone.ttft_p99_s,
            "batch_alone_tokens_per_s": base.batch_alone.batch_tokens_per_s,
            "slack_tokens_per_s": base.slack_tokens_per_s,
            "throughput_ratio": ratios[share],
        }
    print(
        f"{sc.name} on measured H200 steps, {sc.duration_s:,.0f} s simulated, "
        f"{sc.batch.items:,} items: {INSTRUCTION_TOKENS}-token instruction per job + 200-600 "
        f"token documents, 200 out; {POLICY}"
    )
    print(table([f.name for f in dataclasses.fields(Row)], [dataclasses.astuple(r) for r in rows]))
    for share, x in ratios.items():
        print(f"pool {share:g} x: shared over whole batch tokens/s {x:.3f}x")
    details["rows"] = [dataclasses.asdict(r) for r in rows]
    finish(NAME, "throughput_ratio", ratios[shares[0]], ">=", GOAL, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
