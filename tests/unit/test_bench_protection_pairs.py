"""The protection benchmark's request-by-request pairing of ``a`` against its baseline."""

from __future__ import annotations

from typing import Any

from bench.protection.pairs import bucket, buckets, pairs, report


def _scenario(name: str, ttfts: list[float | None], arrivals: list[float]) -> dict[str, Any]:
    return {
        "scenario": name,
        "requests": [
            {"index": i, "arrival_s": a, "prompt_tokens": 100 + i, "ttft_s": t}
            for i, (t, a) in enumerate(zip(ttfts, arrivals, strict=True))
        ],
    }


ARRIVALS = [0.0, 0.4, 12.0, 15.0, 15.5]


def test_pairs_match_by_index_and_measure_the_gap_before_each_arrival() -> None:
    base = _scenario("alone-sched", [0.1, 0.2, 0.1, None, 0.1], ARRIVALS)
    other = _scenario("a", [0.1, 0.3, 1.1, 0.5, None], ARRIVALS)
    found = pairs(base, other)
    # Request 3 has no baseline answer, request 4 none in a: both left out of the pairs, but
    # their arrivals still count for the gaps after them.
    assert [p.index for p in found] == [0, 1, 2]
    assert [round(p.gap_s, 3) for p in found[1:]] == [0.4, 11.6]
    assert found[0].gap_s == float("inf")
    assert [round(p.extra_s, 3) for p in found] == [0.0, 0.1, 1.0]


def test_buckets_say_which_arrivals_carry_the_extra() -> None:
    assert (bucket(0.5), bucket(3.0), bucket(30.0)) == ("0-1 s", "1-10 s", ">= 10 s")
    base = _scenario("alone-sched", [0.1, 0.2, 0.1, 0.1, 0.1], ARRIVALS)
    other = _scenario("a", [0.1, 0.3, 1.1, 0.2, 0.1], ARRIVALS)
    rows = {r[0]: r for r in buckets(pairs(base, other))}
    assert rows["0-1 s"][1] == 2
    assert rows["0-1 s"][5] == "8%"
    assert rows[">= 10 s"][1] == 2
    assert rows[">= 10 s"][5] == "83%"
    assert rows["1-10 s"][1] == 1
    assert rows["1-10 s"][5] == "8%"
    assert rows["all"][1] == 5


def test_report_needs_both_scenarios() -> None:
    base = _scenario("alone", [0.1, 0.2, 0.1, 0.1, 0.1], ARRIVALS)
    other = _scenario("a", [0.1, 0.3, 1.1, 0.2, 0.1], ARRIVALS)
    assert report([other]) is None
    text = report([base, other])
    assert text is not None
    assert "a against alone" in text
    assert "#2 at 12.0 s" in text
