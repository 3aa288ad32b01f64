"""check_upload scans a file a piece at a time and agrees with a whole-file reading of it;
the upload's scan cuts it into pieces at line ends and records its forecast bound;
iter_lines (and iter_located_lines, with where each line lies) give a file's lines from any
split of it into pieces (pure, no services)."""

from __future__ import annotations

import io
import itertools
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.batch_input import InputLimits, forecast_tokens_upper_bound, validate_batch_input
from backfill.refusals import InvalidRequest, PayloadTooLarge
from backfill.upload_scan import (
    UploadScan,
    check_upload,
    iter_lines,
    iter_located_lines,
    read_ahead,
)

CHAT = "/v1/chat/completions"
LINES = st.lists(
    st.sampled_from([b"", b" ", b"\r", b"\t \x0c", b"{}", b" {} ", b"x" * 7, b"y" * 13]),
    max_size=40,
)


def _problems(content: bytes, limits: InputLimits) -> set[str]:
    """What is wrong with ``content``, read whole (the reference)."""
    lines = content.split(b"\n")
    requests = sum(1 for raw in lines if raw.strip())
    found = set()
    if len(content) > limits.max_file_bytes:
        found.add("file_too_large")
    if any(len(raw) > limits.max_line_bytes for raw in lines):
        found.add("line_too_long")
    if requests == 0:
        found.add("empty_file")
    if requests > limits.max_lines:
        found.add("too_many_lines")
    return found


@given(
    lines=LINES,
    trailing_newline=st.booleans(),
    scan_bytes=st.integers(1, 64),
    max_file=st.integers(1, 400),
    max_line=st.integers(1, 14),
    max_lines=st.integers(1, 30),
)
def test_a_piecewise_scan_refuses_exactly_what_a_whole_reading_refuses(
    lines: list[bytes],
    trailing_newline: bool,
    scan_bytes: int,
    max_file: int,
    max_line: int,
    max_lines: int,
) -> None:
    content = b"\n".join(lines) + (b"\n" if trailing_newline else b"")
    limits = InputLimits(max_file, max_line, max_lines, 4096, 16)
    problems = _problems(content, limits)
    if not problems:
        count = check_upload(io.BytesIO(content), limits, scan_bytes=scan_bytes)
        assert count == sum(1 for raw in content.split(b"\n") if raw.strip())
        return
    with pytest.raises((InvalidRequest, PayloadTooLarge)) as refused:
        check_upload(io.BytesIO(content), limits, scan_bytes=scan_bytes)
    code = refused.value.code
    assert code in problems, (code, problems)


def test_the_line_numbers_of_a_refusal_count_every_line_before_it() -> None:
    limits = InputLimits(10_000, 8, 100, 4096, 16)
    content = b"{}\n\n{}\n" + b"z" * 9 + b"\n{}\n"
    for scan_bytes in (1, 3, 4, 64):
        with pytest.raises(InvalidRequest, match=r"^line 4 is ") as refused:
            check_upload(io.BytesIO(content), limits, scan_bytes=scan_bytes)
        assert refused.value.code == "line_too_long"


def test_a_file_object_is_read_from_where_it_stands_and_not_past_its_end() -> None:
    source = io.BytesIO(b"ignored header\n{}\n{}\n")
    source.seek(len(b"ignored header\n"))
    assert check_upload(source, InputLimits(100, 20, 5, 4096, 16)) == 2


@given(content=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_iter_lines_gives_the_lines_of_any_split_into_pieces(
    content: bytes, cuts: list[int]
) -> None:
    bounds = sorted({0, len(content), *(c for c in cuts if c <= len(content))})
    pieces = [content[a:b] for a, b in itertools.pairwise(bounds)]
    assert list(iter_lines(pieces)) == content.split(b"\n")


def test_validation_of_lines_read_piecewise_matches_that_of_the_bytes() -> None:
    limits = InputLimits(10_000, 1000, 100, 4096, 16)
    good = (
        b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}}'
    )
    content = good + b"\n\n" + good.replace(b'"a"', b'"b"') + b"\nnot json\n"
    whole = validate_batch_input(content, CHAT, limits)
    piecewise = validate_batch_input(
        iter_lines(content[i : i + 7] for i in range(0, len(content), 7)), CHAT, limits
    )
    assert whole == piecewise


@given(
    lines=LINES,
    trailing_newline=st.booleans(),
    piece_bytes=st.integers(1, 64),
    scan_bytes=st.integers(1, 64),
)
def test_the_scan_cuts_a_file_into_pieces_that_end_at_line_ends(
    lines: list[bytes], trailing_newline: bool, piece_bytes: int, scan_bytes: int
) -> None:
    content = b"\n".join([*lines, b"{}"]) + (b"\n" if trailing_newline else b"")
    limits = InputLimits(10_000, 10_000, 10_000, 4096, 16)
    scan = UploadScan(io.BytesIO(content), limits, piece_bytes=piece_bytes, scan_bytes=scan_bytes)
    pieces = list(scan.pieces())
    assert b"".join(pieces) == content
    assert all(p.endswith(b"\n") for p in pieces[:-1])
    assert scan.requests == sum(1 for raw in content.split(b"\n") if raw.strip())
    located = list(iter_located_lines(pieces))
    assert [line for line, _ in located] == content.split(b"\n")
    for line, spot in located:
        if line:
            assert spot is not None, line
            seq, at, length = spot
            assert pieces[seq][at : at + length] == line


@given(content=st.binary(max_size=200), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_located_lines_of_any_split_say_where_each_whole_line_lies(
    content: bytes, cuts: list[int]
) -> None:
    bounds = sorted({0, len(content), *(c for c in cuts if c <= len(content))})
    pieces = [content[a:b] for a, b in itertools.pairwise(bounds)]
    located = list(iter_located_lines(pieces))
    assert [line for line, _ in located] == content.split(b"\n")
    for line, spot in located:
        if spot is not None:
            seq, at, length = spot
            assert pieces[seq][at : at + length] == line


def test_the_scan_records_the_forecast_bound_of_the_whole_file() -> None:
    good = (
        b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}}'
    )
    content = b"\n".join([good] * 50 + [good.replace(b"max_tokens", b"max_completion_tokens")])
    scan = UploadScan(io.BytesIO(content), InputLimits(10**6, 1000, 100, 4096, 16), piece_bytes=300)
    assert len(list(scan.pieces())) > 3
    assert scan.tokens_bound == forecast_tokens_upper_bound(content)


def test_read_ahead_gives_every_piece_in_order_and_raises_where_fetching_failed() -> None:
    pieces = [bytes([i]) * 10 for i in range(20)]
    assert list(read_ahead(iter(pieces))) == pieces

    def failing() -> Iterator[bytes]:
        yield b"first"
        raise RuntimeError("the store went away")

    ahead = read_ahead(failing())
    assert next(ahead) == b"first"
    with pytest.raises(RuntimeError, match="went away"):
        next(ahead)


def test_a_consumer_that_stops_early_stops_the_read_ahead() -> None:
    fetched = []

    def endless() -> Iterator[bytes]:
        i = 0
        while True:
            fetched.append(i)
            yield b"x"
            i += 1

    ahead = read_ahead(endless(), depth=2)
    assert next(ahead) == b"x"
    ahead.close()
    time.sleep(0.5)
    count = len(fetched)
    time.sleep(0.3)
    assert len(fetched) == count < 10
