"""``bench.prefix``'s workload and verdict: the instruction's size, the documents' lengths and
text, and the goal held only when every condition holds."""

from __future__ import annotations

import pytest

from bench.throughput.prefix_timeline import timeline
from bench.throughput.prefix_workload import (
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


def test_rules_for_an_instruction_of_the_target_size() -> None:
    # 40 tokens with one rule, 220 with ten: 20 a rule; 1,000 tokens need 49 rules.
    assert rules_for(1000, 40, 220) == 49
    assert rules_for(10, 40, 220) == 1
    with pytest.raises(ValueError, match="rules add no tokens"):
        rules_for(1000, 40, 40)
    assert instruction(3).count("Rule ") == 3
    assert instruction(2).startswith(instruction(1).splitlines()[0])
    with pytest.raises(ValueError, match="at least one rule"):
        instruction(0)


def test_document_lengths_are_seeded_and_within_bounds() -> None:
    lengths = doc_lengths(500, 200, 600, seed=1)
    assert len(lengths) == 500
    assert min(lengths) >= 200
    assert max(lengths) <= 600
    assert max(lengths) - min(lengths) > 300  # spread, not one length
    assert doc_lengths(500, 200, 600, seed=1) == lengths
    with pytest.raises(ValueError, match="0 < low <= high"):
        doc_lengths(3, 600, 200)


def test_output_lengths_alike_or_varied_about_the_mean() -> None:
    assert output_lengths(3, 200, vary=False) == [200, 200, 200]
    varied = output_lengths(400, 200, vary=True, seed=2)
    assert min(varied) >= 100
    assert max(varied) <= 300
    assert len(set(varied)) > 50  # items end apart
    assert 180 <= sum(varied) / len(varied) <= 220
    assert output_lengths(400, 200, vary=True, seed=2) == varied
    with pytest.raises(ValueError, match="at least 2"):
        output_lengths(3, 1, vary=True)


def test_documents_differ_and_have_the_length_asked_even_past_the_corpus() -> None:
    corpus = "abcdefghij" * 10
    a, b = document(corpus, 0, 50), document(corpus, 1, 50)
    assert a != b
    assert a.startswith("Document 0.\n")
    assert len(a) == len("Document 0.\n") + 50
    assert len(document(corpus, 3, 450)) == len("Document 3.\n") + 450
    with pytest.raises(ValueError, match="empty"):
        document("", 0, 10)
    shared = instruction(2)
    assert prompt(shared, a).startswith(shared)
    body = request_body("tiny", "x", 200)
    assert body["max_tokens"] == 200
    assert body["ignore_eos"] is True
    assert body["temperature"] == 0
    assert body["messages"] == [{"role": "user", "content": "x"}]


def test_the_quick_run_is_the_tiny_model_with_the_issues_shape() -> None:
    w = workload(True)
    assert w.model == "tiny"
    assert (w.instruction_tokens, w.doc_tokens, w.max_tokens) == (1000, (200, 600), 200)
    assert workload(False).model == "smollm2"
    assert workload(True, "smollm2").model == "smollm2"


def _side(name: str, seconds: float, tokens: int, conc: list[int], over: int = 0) -> SideResult:
    return SideResult(name, 10, seconds, tokens, conc, over, len(conc))


def test_the_verdict_holds_only_when_every_condition_does() -> None:
    whole = _side("whole", 100.0, 2000, [4, 8, 8])
    shared = _side("shared", 50.0, 2000, [10, 20, 18])
    client = _side("client", 50.0, 2000, [20])
    assert shared.peak == 20
    assert shared.mean == pytest.approx(16.0)
    assert shared.tokens_per_s == 40.0
    v = verdict(shared, whole, client)
    assert v.concurrency_ratio == 2.5
    assert v.throughput_ratio == 2.0
    assert v.straight_ratio == 1.0
    assert v.holds
    slow_client_side = verdict(shared, whole, _side("client", 40.0, 2000, [20]))
    assert slow_client_side.straight_ratio == pytest.approx(0.8)
    assert not slow_client_side.holds
    over = verdict(_side("shared", 50.0, 2000, [20], over=128), whole, client)
    assert over.over_reserved == 128
    assert not over.holds
    assert [held for *_, held in over.checks] == [True, True, True, False]
    assert not verdict(_side("shared", 50.0, 2000, [12]), whole, client).holds  # 1.5x
    rows = side_rows([shared, SideResult("run-batch", 10, 40.0, 2000)])
    assert rows[0][5:] == (20, pytest.approx(16.0), 0)
    assert rows[1][5:] == ("-", "-", "-")
    assert over_reserved(100, 128) == 0
    assert over_reserved(256, 128) == 128


def test_a_sides_timeline_weighs_running_sequences_by_time_and_says_when_slots_sat_empty() -> None:
    # Two slots: one item runs 0-1 s, the next starts 0.5 s after it ended; another 0.5-2 s.
    t = timeline([(0.0, 1.0), (1.5, 2.0), (0.5, 2.0)], 2.0)
    assert t.peak == 2
    assert t.first_start_s == 0.0
    assert t.mean_running == (1 * 0.5 + 2 * 0.5 + 1 * 0.5 + 2 * 0.5) / 2.0
    # Below the peak of 2 from the first start to the last: 0-0.5 s and 1-1.5 s.
    assert t.below_peak_s == 1.0
    assert t.starts_by_tenth[0] == t.starts_by_tenth[5] == t.starts_by_tenth[15] == 1
    assert t.ends_by_tenth[10] == 1
    assert t.ends_by_tenth[20] == 2
