"""``bench.prefix_sim``: its backlog is ``bench.prefix``'s shape on the H200 scenario, and where
the pool binds, reserving the shared instruction once runs more items than reserving it whole."""

from __future__ import annotations

import dataclasses

from backfill_analysis.simulate import compare
from backfill_analysis.simulate.trace import AZURE_CODE_TRACE
from bench.simulator.prefix_sim import INSTRUCTION_TOKENS, Row, prefix_scenario, ratio, run_setting


def test_the_backlog_is_a_shared_instruction_before_each_document() -> None:
    sc = prefix_scenario(quick=True, pool_share=0.5)
    assert sc.name == "h200-llama-3.1-8b"
    assert sc.engine.num_blocks == prefix_scenario(quick=True).engine.num_blocks // 2
    trace, items = compare.workload(dataclasses.replace(sc, duration_s=30.0), AZURE_CODE_TRACE, 0)
    assert trace
    assert all(i.prefix_tokens == INSTRUCTION_TOKENS for i in items)
    assert all(200 <= i.prompt_tokens - INSTRUCTION_TOKENS <= 600 for i in items)
    assert {(i.max_output_tokens, i.output_tokens) for i in items} == {(200, 200)}


def test_where_the_pool_binds_the_shared_ledger_runs_more_items() -> None:
    sc = dataclasses.replace(prefix_scenario(quick=True, pool_share=0.0625), duration_s=60.0)
    trace, items = compare.workload(sc, AZURE_CODE_TRACE, 0)
    whole, most_whole, _ = run_setting(sc, trace, items, "whole")
    shared, most_shared, _ = run_setting(sc, trace, items, "shared")
    assert most_shared > 2 * most_whole
    assert shared.batch_tokens_per_s > whole.batch_tokens_per_s


def test_the_ratio_is_shared_over_whole() -> None:
    rows = [
        Row(1, "whole", 100.0, 0.5, 0.5, 1, 1.0, 1.0, 1.0),
        Row(1, "shared", 150.0, 0.75, 0.75, 2, 2.0, 1.0, 1.0),
    ]
    assert ratio(rows) == 1.5
