"""Pure helpers of ``bench.pg_scale``: partition DDL, index copies, plan and window summaries.

Nothing here talks to a database, so each piece is pinned down by a unit test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from bench.common import percentile


@dataclass(frozen=True, slots=True)
class PartitionBound:
    """One RANGE partition: ``[lo, hi)`` of the partition key."""

    name: str
    lo: datetime
    hi: datetime


def partition_bounds(
    parent: str, first: datetime, last: datetime, step: timedelta
) -> list[PartitionBound]:
    """Partitions of ``step`` covering ``[first, last]``, aligned to midnight of ``first``'s
    day, named ``PARENT_pYYYYMMDD[HH]`` after their lower bound."""
    if step <= timedelta(0):
        raise ValueError("a partition step must be positive")
    lo = first.replace(hour=0, minute=0, second=0, microsecond=0)
    fmt = "%Y%m%d" if step % timedelta(days=1) == timedelta(0) else "%Y%m%d%H"
    out = []
    while lo <= last:
        hi = lo + step
        out.append(PartitionBound(f"{parent}_p{lo.strftime(fmt)}", lo, hi))
        lo = hi
    return out


def partition_ddl(parent: str, bounds: Iterable[PartitionBound]) -> list[str]:
    """``CREATE TABLE ... PARTITION OF`` for each bound."""
    return [
        f"CREATE TABLE {b.name} PARTITION OF {parent} "
        f"FOR VALUES FROM ('{b.lo.isoformat()}') TO ('{b.hi.isoformat()}')"
        for b in bounds
    ]


_CREATE_INDEX = re.compile(
    r"^CREATE (?P<unique>UNIQUE )?INDEX (?P<name>\S+) ON (?:ONLY )?(?P<table>\S+) (?P<rest>.*)$"
)


def copy_index(indexdef: str, source: str, target: str) -> str:
    """``pg_get_indexdef`` of an index on ``source`` rewritten to build the same index on
    ``target`` (a partitioned table: the index is made on every partition). The name's
    ``source`` prefix becomes ``target``'s; the column list and partial predicate are kept."""
    m = _CREATE_INDEX.match(indexdef)
    if m is None:
        raise ValueError(f"not a CREATE INDEX statement: {indexdef}")
    table = m["table"].rpartition(".")[2]
    if table != source:
        raise ValueError(f"index on {table}, not {source}: {indexdef}")
    name = m["name"].replace(source, target, 1) if source in m["name"] else f"{target}_{m['name']}"
    return f"CREATE {m['unique'] or ''}INDEX {name} ON {target} {m['rest']}"


@dataclass(slots=True)
class PlanSummary:
    """What one ``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`` says, in a few figures."""

    lines: list[str] = field(default_factory=list)
    """One line per plan node, indented by depth: type, relation/index, rows x loops."""
    indexes: list[str] = field(default_factory=list)
    """Indexes scanned, in plan order, once each."""
    relations: list[str] = field(default_factory=list)
    """Tables (or partitions) scanned, once each."""
    subplans_removed: int = 0
    """Partitions pruned at executor start-up or run time (Append's ``Subplans Removed``)."""
    shared_hit: int = 0
    shared_read: int = 0
    shared_dirtied: int = 0
    execution_ms: float = 0.0
    planning_ms: float = 0.0


def summarise_plan(explained: Sequence[Mapping[str, Any]] | Mapping[str, Any]) -> PlanSummary:
    """Summarise the JSON of ``EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON)`` (the list it returns
    or its one element). Buffers are the top node's (they include its children's)."""
    top = explained[0] if isinstance(explained, Sequence) else explained
    out = PlanSummary(
        execution_ms=float(top.get("Execution Time", 0.0)),
        planning_ms=float(top.get("Planning Time", 0.0)),
    )
    root = top["Plan"]
    out.shared_hit = int(root.get("Shared Hit Blocks", 0))
    out.shared_read = int(root.get("Shared Read Blocks", 0))
    out.shared_dirtied = int(root.get("Shared Dirtied Blocks", 0))

    def walk(node: Mapping[str, Any], depth: int) -> None:
        what = str(node["Node Type"])
        if "Index Name" in node:
            what += f" using {node['Index Name']}"
            if node["Index Name"] not in out.indexes:
                out.indexes.append(str(node["Index Name"]))
        if "Relation Name" in node:
            what += f" on {node['Relation Name']}"
            if node["Relation Name"] not in out.relations:
                out.relations.append(str(node["Relation Name"]))
        if "Subplans Removed" in node:
            out.subplans_removed += int(node["Subplans Removed"])
            what += f" (subplans removed: {node['Subplans Removed']})"
        if "CTE Name" in node:
            what += f" [{node['CTE Name']}]"
        rows, loops = node.get("Actual Rows"), node.get("Actual Loops")
        if rows is not None:
            what += f"  rows={rows} loops={loops}"
        out.lines.append("  " * depth + what)
        children = list(node.get("Plans", ()))
        for k, child in enumerate(children):
            if k == 2 and len(children) > 4 and what.startswith(("Append", "Merge Append")):
                # A partitioned table's children read alike: show two, count the rest.
                ran = sum(1 for c in children[2:] if c.get("Actual Loops"))
                out.lines.append("  " * (depth + 1) + f"... {len(children) - 2} more ({ran} ran)")
                for rest in children[2:]:
                    _collect(rest, out)
                break
            walk(child, depth + 1)

    walk(root, 0)
    return out


def _collect(node: Mapping[str, Any], out: PlanSummary) -> None:
    """The indexes and relations of a subtree that is not printed."""
    for key, seen in (("Index Name", out.indexes), ("Relation Name", out.relations)):
        if key in node and node[key] not in seen:
            seen.append(str(node[key]))
    for child in node.get("Plans", ()):
        _collect(child, out)


@dataclass(frozen=True, slots=True)
class Window:
    """Claims that began in one window of a run."""

    start_s: float
    claims: int
    items: int
    p50_ms: float
    p99_ms: float


def summarise_windows(
    claims: Iterable[tuple[float, float, int]], window_s: float, until_s: float
) -> list[Window]:
    """Bin ``(began_s, latency_ms, items)`` claims into windows of ``window_s`` from 0 to
    ``until_s``: claims, items and latency p50/p99 in each (NaN where a window has none). A
    claim belongs to the window it began in; the last, partial window is dropped."""
    n = int(until_s // window_s)
    lat: list[list[float]] = [[] for _ in range(n)]
    items = [0] * n
    for began, ms, k in claims:
        w = int(began // window_s)
        if 0 <= w < n:
            lat[w].append(ms)
            items[w] += k
    return [
        Window(w * window_s, len(lat[w]), items[w], percentile(lat[w], 50), percentile(lat[w], 99))
        for w in range(n)
    ]
