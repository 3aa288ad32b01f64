"""The request edge's rules: which limit and which check each route gets, and how deep a
JSON body may nest (pure, no services)."""

from __future__ import annotations

import json

import pytest

from backfill.config import Settings
from backfill.refusals import InvalidRequest
from queue_api.edge import (
    MAX_JSON_DEPTH,
    MULTIPART_OVERHEAD,
    BodyLimits,
    json_depth,
    load_json_body,
    route_rules,
)

LIMITS = BodyLimits.from_settings(Settings())


@pytest.mark.parametrize(
    ("method", "path", "limit", "needs_key", "limited"),
    [
        ("POST", "/v1/files", 200 * 1024 * 1024 + MULTIPART_OVERHEAD, True, False),
        ("GET", "/v1/files", 64 * 1024, True, False),
        ("POST", "/v1/chat/completions", 4 * 1024 * 1024, True, False),
        ("POST", "/v1/completions", 4 * 1024 * 1024, True, False),
        ("POST", "/v1/batches", 64 * 1024, True, False),
        ("POST", "/v1/batches/batch_1/cancel", 64 * 1024, True, False),
        ("GET", "/v1/nowhere", 64 * 1024, True, False),  # every /v1 path wants a key first
        ("POST", "/lab/kv", 64 * 1024, False, True),
        ("GET", "/metrics", 64 * 1024, False, True),
        ("GET", "/healthz", 64 * 1024, False, True),
        ("GET", "/dashboard/app.js", 64 * 1024, False, False),
        ("GET", "/openapi.json", 64 * 1024, False, False),
        ("GET", "/v1x", 64 * 1024, False, False),
    ],
)
def test_each_route_gets_its_body_limit_and_its_checks(
    method: str, path: str, limit: int, needs_key: bool, limited: bool
) -> None:
    rules = route_rules(method, path, LIMITS)
    assert (rules.max_body_bytes, rules.needs_key, rules.anonymous_limited) == (
        limit,
        needs_key,
        limited,
    )


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_json_depth_counts_arrays_and_objects() -> None:
    assert json_depth(1) == 0
    assert json_depth([]) == 1
    assert json_depth({"a": [{"b": 2}, 3]}) == 3
    assert json_depth(json.loads(_nested(200))) == MAX_JSON_DEPTH + 1  # it stops counting


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5000, 200_000])
def test_a_body_nested_too_deeply_is_a_400_not_a_crash(depth: int) -> None:
    with pytest.raises(InvalidRequest, match="nested deeper"):
        load_json_body(_nested(depth))


def test_a_body_within_the_depth_and_bad_json_are_told_apart() -> None:
    assert load_json_body(_nested(MAX_JSON_DEPTH)) is not None
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        load_json_body(b'{"model": ')


@pytest.mark.parametrize(
    ("method", "path", "query", "cost"),
    [
        ("GET", "/v1/files", b"", 20),  # OpenAI's default page: 10,000 files
        ("GET", "/v1/files", b"limit=10000&order=asc", 20),
        ("GET", "/v1/files", b"limit=500", 1),
        ("GET", "/v1/files", b"limit=501", 2),
        ("GET", "/v1/files", b"limit=20&after=file-x", 1),
        ("GET", "/v1/files", b"limit=99999", 20),  # the route refuses it; it costs no more
        ("GET", "/v1/files", b"limit=x", 1),  # nor does a limit that is not a number
        ("GET", "/v1/files/file-x", b"", 1),
        ("POST", "/v1/files", b"", 1),
        ("GET", "/v1/batches", b"limit=100", 1),
    ],
)
def test_a_page_of_files_costs_the_rate_limit_a_token_per_500_files(
    method: str, path: str, query: bytes, cost: int
) -> None:
    assert route_rules(method, path, LIMITS, query).rate_cost == cost
