"""The engine configurations the step scheduler refuses at start-up (``backfill_vllm.refusals``,
pure: no vLLM here). The scheduler's own tests check that it raises on them with vLLM's real
scheduler (``backfill_vllm/tests``)."""

from __future__ import annotations

import pytest

from backfill_vllm.refusals import EngineFacts, refusal_line, refusals


def test_the_engine_backfill_runs_on_is_not_refused() -> None:
    assert refusals(EngineFacts("priority")) == []


@pytest.mark.parametrize(
    ("facts", "named"),
    [
        (EngineFacts("fcfs"), "--scheduling-policy fcfs"),
        (EngineFacts("priority", pipeline_parallel_size=2), "--pipeline-parallel-size 2"),
        (EngineFacts("priority", data_parallel_size=4), "--data-parallel-size 4"),
        (EngineFacts("priority", kv_connector="NixlConnector"), "NixlConnector"),
        (EngineFacts("priority", num_spec_tokens=3), "3 speculative tokens"),
    ],
)
def test_each_unhandled_configuration_is_refused_by_name(facts: EngineFacts, named: str) -> None:
    reasons = refusals(facts)
    assert len(reasons) == 1
    assert named in reasons[0]


def test_every_reason_is_given_at_once_in_one_line() -> None:
    facts = EngineFacts("fcfs", pipeline_parallel_size=2, num_spec_tokens=1)
    line = refusal_line(refusals(facts))
    assert "\n" not in line
    assert line.count(";") == 2
    assert line.endswith("drop --scheduler-cls to run vLLM's own scheduler")
