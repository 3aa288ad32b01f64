"""The pure parts of ``bench.interactive_overhead``: ratios, pairing and the verdict's share."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench import common
from bench.protection.overhead import SHAPES, Comparison, Side, _shapes


def _side(name: str, ttfts: list[float]) -> Side:
    side = Side(name)
    for i, t in enumerate(ttfts):
        side.add(SHAPES[i % len(SHAPES)], t)
    return side


def test_ratios_pair_requests_by_position_and_judge_the_worse_percentile() -> None:
    base = _side("stock", [0.1, 0.2, 0.4, 0.8, 1.0])
    other = _side("scheduler", [0.11, 0.2, 0.4, 0.8, 1.2])
    c = Comparison("scheduler", base, other, 1.02)
    assert c.ratio(50) == pytest.approx(1.0)
    assert c.ratio(99) > 1.15
    assert c.paired() == pytest.approx(1.0)
    assert c.worst_share() == pytest.approx(c.ratio(99) / 1.02)
    summary = c.summary()
    assert summary["requests_per_side"] == 5
    assert summary["stock"]["p50"] == pytest.approx(0.4)


def test_every_block_sends_each_shape_equally_often() -> None:
    shapes = _shapes(30, random.Random(0))
    assert sorted(shapes) == sorted(SHAPES * 6)


def test_the_closing_line_never_shows_a_short_figure_as_the_goal_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(common, "OUT_DIR", tmp_path)
    assert not common.finish("x", "share", 1.005, "<=", 1.0, {})
    assert capsys.readouterr().out.strip() == "x: share=1.005 (goal <= 1.0) short"
    assert common.finish("x", "share", 0.98, "<=", 1.0, {})
    assert capsys.readouterr().out.strip() == "x: share=0.98 (goal <= 1.0) ok"


def test_block_medians_follow_the_blocks_in_the_order_they_ran() -> None:
    side = Side("gateway")
    for block in ([0.1, 0.3, 0.2], [1.0, 2.0]):
        side.begin_block()
        for t in block:
            side.add(100, t)
    side.begin_block()  # a block with no requests (stopped early) is left out
    assert side.block_p50s() == [0.2, 1.5]
