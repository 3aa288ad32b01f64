"""Completion windows and deadline feasibility (pure functions)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from backfill.windows import (
    InvalidWindow,
    batch_throughput,
    checked_window,
    format_window,
    parse_window,
    plan_deadline,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("24h", 86400),
        ("30m", 1800),
        ("72h", 259200),
        ("1h30m", 5400),
        ("2d", 172800),
        ("90s", 90),
        ("1d2h3m4s", 93784),
        (" 24H ", 86400),
    ],
)
def test_durations_parse_to_seconds(text: str, seconds: int) -> None:
    assert parse_window(text) == seconds


@pytest.mark.parametrize("text", ["", "24", "h", "soon", "1h 30m", "30m1h", "-1h", "1.5h"])
def test_malformed_durations_are_refused(text: str) -> None:
    with pytest.raises(InvalidWindow) as err:
        parse_window(text)
    assert err.value.param == "completion_window"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (86400, "24h"),
        (5400, "1h30m"),
        (1800, "30m"),
        (259200, "72h"),
        (4 * 86400, "4d"),
        (3 * 86400 + 3600, "3d1h"),
        (61, "1m1s"),
    ],
)
def test_windows_format_canonically_and_round_trip(seconds: int, text: str) -> None:
    assert format_window(seconds) == text
    assert parse_window(text) == seconds


def test_windows_outside_the_bounds_are_refused() -> None:
    assert checked_window("30m", 300, 86400) == 1800
    with pytest.raises(InvalidWindow, match="between 5m and 24h"):
        checked_window("1m", 300, 86400)
    with pytest.raises(InvalidWindow):
        checked_window("25h", 300, 86400)


def test_a_batch_that_fits_behind_the_backlog_is_feasible_with_its_eta() -> None:
    plan = plan_deadline(
        NOW, 3600, backlog_tokens=1_000_000, batch_tokens=800_000, throughput_tps=1000.0
    )
    assert plan.feasible
    assert plan.estimated_completion == NOW + timedelta(seconds=1800)
    assert plan.deadline == NOW + timedelta(hours=1)


def test_an_infeasible_window_names_the_earliest_round_window_that_fits() -> None:
    plan = plan_deadline(
        NOW, 1800, backlog_tokens=7_000_000, batch_tokens=261_000, throughput_tps=1000.0
    )
    assert not plan.feasible
    # 7261 s needed: offered in 5-minute steps.
    assert plan.earliest_window_s == 7500
    assert plan.earliest_window == "2h5m"
    assert plan_deadline(
        NOW,
        plan.earliest_window_s,
        backlog_tokens=7_000_000,
        batch_tokens=261_000,
        throughput_tps=1000.0,
    ).feasible


def test_measured_throughput_wins_over_the_configured_one_once_there_is_one() -> None:
    assert batch_throughput(5000.0) == 5000.0
    assert batch_throughput(5000.0, 1234.5) == 1234.5
    assert batch_throughput(5000.0, 0.0) == 5000.0
