"""The pure pieces of bench.pg_scale: partition DDL, index copies, plan and window summaries."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from itertools import pairwise

import pytest

from bench.pg_scale.plan import (
    copy_index,
    partition_bounds,
    partition_ddl,
    summarise_plan,
    summarise_windows,
)


def test_daily_partitions_cover_the_span_from_midnight_without_gaps() -> None:
    first = datetime(2026, 11, 4, 13, 30, tzinfo=UTC)
    last = datetime(2026, 11, 6, 0, 0, tzinfo=UTC)
    bounds = partition_bounds("items_p", first, last, timedelta(days=1))
    assert [b.name for b in bounds] == [
        "items_p_p20261104",
        "items_p_p20261105",
        "items_p_p20261106",
    ]
    assert bounds[0].lo == datetime(2026, 11, 4, tzinfo=UTC)
    assert all(a.hi == b.lo for a, b in pairwise(bounds))
    assert bounds[-1].lo <= last < bounds[-1].hi


def test_hourly_partitions_are_named_by_hour() -> None:
    first = datetime(2026, 11, 4, 0, 10, tzinfo=UTC)
    bounds = partition_bounds("t", first, first + timedelta(hours=7), timedelta(hours=6))
    assert [b.name for b in bounds] == ["t_p2026110400", "t_p2026110406"]


def test_a_step_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        partition_bounds(
            "t", datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC), timedelta(0)
        )


def test_partition_ddl_names_each_range() -> None:
    lo = datetime(2026, 11, 4, tzinfo=UTC)
    [ddl] = partition_ddl("items_p", partition_bounds("items_p", lo, lo, timedelta(days=7)))
    assert ddl == (
        "CREATE TABLE items_p_p20261104 PARTITION OF items_p FOR VALUES FROM "
        "('2026-11-04T00:00:00+00:00') TO ('2026-11-11T00:00:00+00:00')"
    )


def test_an_index_copy_keeps_columns_and_partial_predicate() -> None:
    d = (
        "CREATE INDEX ix_items_claim_edf ON public.items USING btree (deadline, id) "
        "WHERE ((state)::text = ANY ((ARRAY['deferred'::character varying])::text[]))"
    )
    assert copy_index(d, "items", "items_p") == (
        "CREATE INDEX ix_items_p_claim_edf ON items_p USING btree (deadline, id) "
        "WHERE ((state)::text = ANY ((ARRAY['deferred'::character varying])::text[]))"
    )


def test_an_index_of_another_table_is_refused() -> None:
    with pytest.raises(ValueError, match="not items"):
        copy_index("CREATE INDEX ix_jobs_x ON public.jobs USING btree (id)", "items", "items_p")


_PLAN = [
    {
        "Plan": {
            "Node Type": "ModifyTable",
            "Relation Name": "items_p",
            "Actual Rows": 0,
            "Actual Loops": 1,
            "Shared Hit Blocks": 120,
            "Shared Read Blocks": 3,
            "Shared Dirtied Blocks": 7,
            "Plans": [
                {
                    "Node Type": "Append",
                    "Subplans Removed": 28,
                    "Actual Rows": 64,
                    "Actual Loops": 1,
                    "Plans": [
                        {
                            "Node Type": "Index Scan",
                            "Index Name": f"items_p_p{d}_deadline_id_idx",
                            "Relation Name": f"items_p_p{d}",
                            "Actual Rows": 64,
                            "Actual Loops": 1 if d == 1 else 0,
                        }
                        for d in range(1, 7)
                    ],
                }
            ],
        },
        "Planning Time": 30.5,
        "Execution Time": 4.25,
    }
]


def test_a_plan_summary_counts_pruned_partitions_and_buffers_and_folds_alike_children() -> None:
    s = summarise_plan(_PLAN)
    assert (s.shared_hit, s.shared_read, s.shared_dirtied) == (120, 3, 7)
    assert (s.execution_ms, s.planning_ms, s.subplans_removed) == (4.25, 30.5, 28)
    assert s.lines[0] == "ModifyTable on items_p  rows=0 loops=1"
    assert s.lines[1] == "  Append (subplans removed: 28)  rows=64 loops=1"
    assert s.lines[-1] == "    ... 4 more (0 ran)"
    assert len(s.lines) == 5
    # Folded children still count among the indexes scanned.
    assert len(s.indexes) == 6
    assert s.relations[0] == "items_p"


def test_windows_bin_claims_by_when_they_began_and_drop_the_partial_tail() -> None:
    claims = [(0.5, 10.0, 64), (1.5, 30.0, 64), (9.9, 20.0, 10), (10.0, 5.0, 64), (25.0, 1.0, 1)]
    w = summarise_windows(claims, 10.0, 25.0)
    assert [(x.start_s, x.claims, x.items) for x in w] == [(0.0, 3, 138), (10.0, 1, 64)]
    assert w[0].p50_ms == 20.0
    assert w[1].p99_ms == 5.0


def test_a_window_without_claims_has_no_latency() -> None:
    [w] = summarise_windows([], 10.0, 10.0)
    assert w.claims == 0
    assert math.isnan(w.p99_ms)
