"""bench.fairness's arithmetic: output tokens and sequences per tenant in a phase."""

from __future__ import annotations

import pytest

from bench.fairness.run import Interval, phase


def test_a_phase_counts_each_items_tokens_by_its_overlap() -> None:
    items = [
        Interval("a", 0.0, 10.0, 100),  # half inside [5, 15)
        Interval("b", 5.0, 15.0, 40),  # all inside
        Interval("b", 20.0, 30.0, 999),  # outside
    ]
    p = phase(items, 5.0, 15.0)
    assert p["tokens_a"] == pytest.approx(50)
    assert p["tokens_b"] == pytest.approx(40)
    assert p["b_share"] == pytest.approx(40 / 90)
    assert p["tokens_per_s"] == pytest.approx(9.0)
    # Mean sequences held: A half the phase, B all of it.
    assert (p["seqs_a"], p["seqs_b"]) == (pytest.approx(0.5), pytest.approx(1.0))


def test_an_empty_phase_has_no_share() -> None:
    assert phase([], 0.0, 1.0)["b_share"] == 0.0
