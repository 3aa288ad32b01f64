"""``backfill plan`` and ``backfill simulate``: capacity planning and the trace-driven
simulator from the command line. The logic is in :mod:`backfill_analysis.planner` and
:mod:`backfill_analysis.simulate`; this module parses options and prints."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

from backfill.errors import BackfillError
from backfill_analysis.simulate.trace import AZURE_CODE_TRACE


def _fail(message: str) -> typer.Exit:
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(1)


def _plan_rows(p: Any) -> list[tuple[str, str]]:
    rows = [
        ("model", p.model),
        ("KV bytes per token (model)", f"{p.kv_bytes_per_token:,}"),
        ("KV bytes per token (per GPU)", f"{p.kv_bytes_per_token_per_gpu:,}"),
        ("weights per GPU", f"{p.weights_bytes_per_gpu / 2**30:,.2f} GiB"),
        ("KV budget per GPU", f"{p.kv_budget_bytes_per_gpu / 2**30:,.2f} GiB"),
        ("pool", f"{p.num_blocks:,} blocks x {p.block_size} = {p.capacity_tokens:,} tokens"),
        ("interactive reserve", f"{p.interactive_reserve_tokens:,} tokens"),
    ]
    if p.trace_p99_tokens is not None:
        rows.append(
            ("trace demand p99 / peak", f"{p.trace_p99_tokens:,} / {p.trace_peak_tokens:,} tokens")
        )
    for fit in p.fits:
        rows.append(
            (
                f"{fit.service_class} sequences of {fit.sequence_tokens:,}",
                f"{fit.sequences:,} (in {fit.pool_tokens:,} tokens)",
            )
        )
    return rows


def plan(
    model: Annotated[str, typer.Option(help="A preset: llama-3.1-8b, qwen2.5-72b, ...")] = (
        "llama-3.1-8b"
    ),
    gpu: Annotated[str, typer.Option(help="GPU preset (h100, h200, a100).")] = "h100",
    gpu_memory_gib: Annotated[float | None, typer.Option(help="Overrides the preset.")] = None,
    tensor_parallel: Annotated[int, typer.Option(min=1)] = 1,
    gpu_memory_utilization: Annotated[float, typer.Option(min=0.01, max=1.0)] = 0.9,
    activation_gib: Annotated[float, typer.Option(min=0.0, help="Per GPU.")] = 2.0,
    kv_cache_gib: Annotated[
        float | None, typer.Option(help="KV budget per GPU directly (vLLM on CPU).")
    ] = None,
    block_size: Annotated[int, typer.Option(min=1)] = 16,
    interactive_tokens: Annotated[int, typer.Option(min=1)] = 4096,
    batch_tokens: Annotated[int, typer.Option(min=1)] = 1024,
    reserve_fraction: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.25,
    trace: Annotated[Path | None, typer.Option(help="Interactive trace CSV.")] = None,
    trace_every: Annotated[int, typer.Option(min=1, help="Node's share: every n-th.")] = 1,
    decode_rate: Annotated[float, typer.Option(help="Tokens/s per request.")] = 30.0,
    prefill_rate: Annotated[float, typer.Option(help="Prompt tokens/s.")] = 10_000.0,
    engine_url: Annotated[str | None, typer.Option(help="Check against /metrics.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Plan a node's KV pool: bytes per token, blocks, sequences per class, the reserve a
    trace needs; with --engine-url, compare with the pool the engine measured."""
    from backfill_analysis import planner, presets  # noqa: PLC0415
    from backfill_analysis.simulate.trace import TraceOptions, load_trace  # noqa: PLC0415

    try:
        m = presets.model_preset(model)
        memory = (
            int(gpu_memory_gib * 2**30)
            if gpu_memory_gib is not None
            else presets.gpu_preset(gpu).memory_bytes
        )
        hw = planner.Hardware(
            gpu_memory_bytes=memory,
            tensor_parallel=tensor_parallel,
            gpu_memory_utilization=gpu_memory_utilization,
            activation_peak_bytes=int(activation_gib * 2**30),
            kv_budget_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
            block_size=block_size,
        )
        requests = load_trace(trace, TraceOptions(every=trace_every)) if trace else None
        result = planner.plan(
            m,
            hw,
            lengths=(("interactive", interactive_tokens), ("batch", batch_tokens)),
            reserve_fraction=reserve_fraction,
            trace=requests,
            decode_tokens_per_s=decode_rate,
            prefill_tokens_per_s=prefill_rate,
        )
        check = None
        if engine_url:
            from backfill.engine_metrics import parse_cache_config  # noqa: PLC0415 - only here

            text = httpx.get(f"{engine_url.rstrip('/')}/metrics", timeout=10).text
            check = planner.check_against_engine(result, parse_cache_config(text))
    except (BackfillError, httpx.HTTPError, OSError) as exc:
        raise _fail(str(exc).splitlines()[0]) from exc
    if as_json:
        data: dict[str, Any] = dataclasses.asdict(result)
        data["source"] = m.source
        if check is not None:
            data["engine_check"] = {**dataclasses.asdict(check), "ratio": check.ratio}
        print(json.dumps(data, indent=2))
        return
    for label, value in _plan_rows(result):
        print(f"{label:<36} {value}")
    print(f"{'source':<36} {m.source}")
    if check is not None:
        verdict = "matches" if check.measured_blocks == check.planned_blocks else "differs"
        print(
            f"{'engine pool (measured)':<36} {check.measured_blocks:,} blocks = "
            f"{check.measured_tokens:,} tokens; plan {verdict} "
            f"(measured/planned {check.ratio:.3f})"
        )


def simulate(
    scenario: Annotated[str, typer.Option(help="h100-llama-3.1-8b or cpu-smollm2.")] = (
        "h100-llama-3.1-8b"
    ),
    trace: Annotated[Path, typer.Option(help="Interactive trace CSV.")] = AZURE_CODE_TRACE,
    duration_s: Annotated[float | None, typer.Option(min=1.0)] = None,
    batch_items: Annotated[int | None, typer.Option(min=0)] = None,
    time_scale: Annotated[float | None, typer.Option(min=0.001)] = None,
    trace_every: Annotated[int | None, typer.Option(min=1)] = None,
    max_prompt: Annotated[int | None, typer.Option(min=1)] = None,
    max_output: Annotated[int | None, typer.Option(min=1)] = None,
    ttft_slo_s: Annotated[float | None, typer.Option(min=0.001)] = None,
    seed: Annotated[int, typer.Option()] = 0,
    policies: Annotated[str, typer.Option(help="Comma-separated.")] = (
        "fifo,static,priority,backfill,backfill-overcommit"
    ),
    sweep: Annotated[bool, typer.Option(help="Also sweep each policy's knob.")] = False,
    out: Annotated[Path, typer.Option(help="Folder for JSON and PNGs.")] = Path("simulate-out"),
    plots: Annotated[bool, typer.Option(help="Draw PNGs.")] = True,
) -> None:
    """Simulate the policies on an engine fed by an interactive trace and a batch backlog;
    print a table, write JSON and plots."""
    from backfill_analysis.simulate import compare, report  # noqa: PLC0415
    from backfill_analysis.simulate.scenario import scenario as make  # noqa: PLC0415

    if plots and importlib.util.find_spec("matplotlib") is None:
        # Before minutes of simulation, not after them.
        raise _fail("plots need matplotlib: pip install 'backfill[analysis]', or --no-plots")
    try:
        sc = make(scenario)
        changes: dict[str, Any] = {}
        for key, value in (
            ("time_scale", time_scale),
            ("every", trace_every),
            ("max_prompt_tokens", max_prompt),
            ("max_output_tokens", max_output),
        ):
            if value is not None:
                changes[key] = value
        sc = dataclasses.replace(
            sc,
            trace=dataclasses.replace(sc.trace, **changes),
            duration_s=duration_s or sc.duration_s,
            ttft_slo_s=ttft_slo_s or sc.ttft_slo_s,
            batch=sc.batch
            if batch_items is None
            else dataclasses.replace(sc.batch, items=batch_items),
        )
        names = [p.strip() for p in policies.split(",") if p.strip()]
        result = compare.compare(sc, trace, seed=seed, policies=names)
        curves = compare.sweep(sc, trace, seed=seed, policies=names) if sweep else None
        paths = report.write(result, out, curves=curves, plot=plots)
    except (BackfillError, ValueError, OSError) as exc:
        raise _fail(str(exc).splitlines()[0]) from exc
    print(
        f"{sc.name}: {result.interactive} interactive requests, {result.batch_items:,} "
        f"batch items, {sc.duration_s:,.0f} s, TTFT target {sc.ttft_slo_s:g} s"
    )
    print(report.table(report.results_rows(result)))
    if curves:
        print("best at >= 99% SLO attainment:")
        print(report.table(report.equal_slo_rows(curves, 0.99, result)))
    for kind, path in paths.items():
        print(f"{kind}: {path}")


def register(app: typer.Typer) -> None:
    """Add the commands to the ``backfill`` app."""
    app.command()(plan)
    app.command()(simulate)
