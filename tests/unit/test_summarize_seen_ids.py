"""A source's duplicate-id check: the same answers as a set of the ids, in a few dozen bytes
a row whatever the ids' length (a 10 GB input of short documents is millions of rows)."""

from __future__ import annotations

import tracemalloc

from hypothesis import given
from hypothesis import strategies as st

from backfill.summarize.documents import Document, RowError, RowGate
from backfill.summarize.seen_ids import SeenIds


@given(st.lists(st.text(max_size=6), max_size=300))
def test_seen_ids_answer_as_a_set_does(keys: list[str]) -> None:
    seen, truth = SeenIds(capacity=2), set()
    for key in keys:
        assert seen.add(key) is (key not in truth)
        truth.add(key)
    assert len(seen) == len(truth)


def test_ids_with_lone_surrogates_are_told_apart() -> None:
    seen = SeenIds()
    assert seen.add("a\udcff")
    assert seen.add("a\udcfe")
    assert seen.add("a")
    assert not seen.add("a\udcff")


def test_the_gate_remembers_ids_in_under_48_bytes_a_row() -> None:
    rows = 100_000
    gate = RowGate()
    tracemalloc.start()
    try:
        start, _ = tracemalloc.get_traced_memory()
        for i in range(rows):
            assert isinstance(gate.admit(i, f"doc-{i:08d}", "text"), Document)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (held - start) / rows < 48
    repeat = gate.admit(rows, "doc-00000007", "text")
    assert isinstance(repeat, RowError)
    assert "duplicate id" in repeat.error
