"""Batch input files: every line checked before anything is stored (pure, no services)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from backfill.batch_input import (
    COMPLETIONS,
    MAX_REPORTED_ERRORS,
    InputLimits,
    InvalidBatch,
    LineInvalid,
    LocatedLines,
    Tally,
    ValidatedBatch,
    _loads,
    stream_valid_items,
    validate_batch_input,
)
from backfill.refusals import InvalidRequest, PayloadTooLarge
from backfill.upload_scan import check_upload
from tests.unit.support_limits import BATCH_LIMITS

CHAT = "/v1/chat/completions"
LIMITS = BATCH_LIMITS


def line(custom_id: str = "a", **body: Any) -> dict[str, Any]:
    full: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 10,
    }
    full.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": full}


def encode(*lines: dict[str, Any] | str) -> bytes:
    return b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)


def test_a_line_without_max_tokens_gets_the_default_written_into_it() -> None:
    # Optional as at OpenAI; Backfill reserves the default and the engine is held to it.
    limits = dataclasses.replace(LIMITS, default_max_tokens=300)
    bare = line("a")
    del bare["body"]["max_tokens"]
    result = validate_batch_input(
        encode(bare, line("b", max_tokens=None), line("c", max_tokens=300)), CHAT, limits
    )
    assert isinstance(result, ValidatedBatch)
    assert [i.max_output_tokens for i in result.items] == [300, 300, 300]
    assert [json.loads(i.body)["max_tokens"] for i in result.items] == [300, 300, 300]
    assert [i.output_defaulted for i in result.items] == [True, True, False]
    assert result.max_output_tokens == 900


def _bare(custom_id: str, prompt_chars: int) -> dict[str, Any]:
    bare = line(custom_id, messages=[{"role": "user", "content": "x" * prompt_chars}])
    del bare["body"]["max_tokens"]
    return bare


def test_a_long_prompt_without_max_tokens_is_accepted_with_what_the_limit_leaves() -> None:
    # As OpenAI and vLLM give a request without max_tokens what the context leaves: never a
    # failure for the default. 4,000 characters are at least 250 tokens (16 bytes a token at
    # most), which leave 3,846 of the limit of 4,096: less than the default of 4,000.
    limits = dataclasses.replace(LIMITS, default_max_tokens=4000)
    result = validate_batch_input(encode(_bare("long", 4_000), _bare("short", 16)), CHAT, limits)
    assert isinstance(result, ValidatedBatch), result
    long, short = result.items
    assert (long.max_output_tokens, long.output_defaulted) == (4096 - 250, True)
    assert json.loads(long.body or "")["max_tokens"] == 4096 - 250
    assert short.max_output_tokens == 4000  # the default, where the prompt leaves more
    assert result.max_output_tokens == 4096 - 250 + 4000


def test_a_default_beyond_the_limit_leaves_a_short_prompt_what_the_limit_leaves() -> None:
    limits = dataclasses.replace(LIMITS, default_max_tokens=10_000)
    result = validate_batch_input(encode(_bare("a", 16)), CHAT, limits)
    assert isinstance(result, ValidatedBatch), result
    assert result.items[0].max_output_tokens == 4096 - 1


def test_a_long_prompt_with_max_tokens_given_still_fails() -> None:
    # The caller's own budget is theirs: it is never cut to fit.
    given = line("a", messages=[{"role": "user", "content": "x" * 4_000}], max_tokens=4000)
    result = validate_batch_input(encode(given), CHAT, LIMITS)
    assert isinstance(result, InvalidBatch)
    (error,) = result.errors
    assert (error.code, error.param) == ("request_too_long", "body.messages")
    assert "at least 250 tokens; with max_tokens 4000" in error.message
    assert "DEFAULT" not in error.message


def test_a_prompt_that_alone_fills_the_limit_is_refused_without_max_tokens() -> None:
    # 65,536 characters are at least 4,096 tokens: nothing of the limit is left for output.
    result = validate_batch_input(encode(_bare("a", 16 * 4096)), CHAT, LIMITS)
    assert isinstance(result, InvalidBatch)
    (error,) = result.errors
    assert (error.code, error.param) == ("request_too_long", "body.messages")
    assert "at least 4096 tokens; it leaves no room for output" in error.message


def test_a_valid_file_becomes_items_in_line_order() -> None:
    result = validate_batch_input(
        encode(line("a"), "", line("b", max_completion_tokens=20)), CHAT, LIMITS
    )
    assert isinstance(result, ValidatedBatch)
    assert [(i.line_no, i.custom_id, i.max_output_tokens) for i in result.items] == [
        (1, "a", 10),
        (3, "b", 20),
    ]
    assert json.loads(result.items[0].body)["messages"][0]["content"] == "hello"
    assert result.model == "m"
    assert result.max_output_tokens == 30
    assert result.items[0].prompt_tokens is None  # exact counts come from the worker


def test_completions_accept_strings_and_token_ids() -> None:
    def completion(custom_id: str, prompt: Any) -> dict[str, Any]:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": COMPLETIONS,
            "body": {"model": "m", "prompt": prompt, "max_tokens": 5},
        }

    ok = validate_batch_input(
        encode(
            completion("a", "once upon"), completion("b", [1, 2, 3]), completion("c", ["x", "y"])
        ),
        COMPLETIONS,
        LIMITS,
    )
    assert isinstance(ok, ValidatedBatch)
    bad = validate_batch_input(encode(completion("a", {"x": 1})), COMPLETIONS, LIMITS)
    assert isinstance(bad, InvalidBatch)
    assert bad.errors[0].code == "invalid_prompt"


def test_a_completions_line_without_max_tokens_gets_what_its_longest_prompt_leaves() -> None:
    # Every prompt is a sequence of its own under the one max_tokens: the longest bounds it.
    limits = dataclasses.replace(LIMITS, default_max_tokens=4000)
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"model": "m", "prompt": ["y", "x" * 4_000]},
    }
    ok = validate_batch_input(encode(line), COMPLETIONS, limits)
    assert isinstance(ok, ValidatedBatch), ok
    [item] = ok.items
    assert (item.max_output_tokens, item.output_defaulted) == (4096 - 250, True)
    assert json.loads(item.body or "")["max_tokens"] == 4096 - 250
    assert ok.max_output_tokens == 2 * (4096 - 250)


def test_a_completions_line_budgeted_in_max_completion_tokens_is_stored_in_max_tokens() -> None:
    # vLLM's completions request knows max_tokens only: a body holding max_completion_tokens
    # alone would generate vLLM's default (16 per prompt) past a reservation of 1.
    def completion(custom_id: str, **budget: int) -> dict[str, Any]:
        body = {"model": "m", "prompt": ["once", "upon"], **budget}
        return {"custom_id": custom_id, "method": "POST", "url": COMPLETIONS, "body": body}

    ok = validate_batch_input(encode(completion("a", max_completion_tokens=1)), COMPLETIONS, LIMITS)
    assert isinstance(ok, ValidatedBatch)
    [item] = ok.items
    stored = json.loads(item.body)
    assert stored["max_tokens"] == 1
    assert "max_completion_tokens" not in stored
    assert item.max_output_tokens == 1
    both = completion("b", max_completion_tokens=1, max_tokens=30)
    bad = validate_batch_input(encode(both), COMPLETIONS, LIMITS)
    assert isinstance(bad, InvalidBatch)
    [error] = bad.errors
    assert (error.code, error.param) == ("invalid_parameter", "body.max_completion_tokens")


def test_a_chat_line_with_a_media_part_is_a_line_error_naming_the_part() -> None:
    # The engine would fetch the URL itself (here a cloud metadata address).
    media = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/"}}
    content = [{"type": "text", "text": "describe"}, media]
    result = validate_batch_input(
        encode(line("a", messages=[{"role": "user", "content": content}]), line("b")),
        CHAT,
        LIMITS,
    )
    assert isinstance(result, InvalidBatch)
    [error] = result.errors
    assert (error.code, error.line, error.param) == ("invalid_messages", 1, "body.messages")
    assert error.message.startswith("body.messages[0].content[1] is a part of type 'image_url'")


CASES: list[tuple[str, dict[str, Any] | str, str, str | None]] = [
    ("invalid JSON", "{", "invalid_json_line", None),
    ("NaN is not JSON", '{"custom_id": "a", "x": NaN}', "invalid_json_line", None),
    ("array", "[]", "invalid_json_line", None),
    ("missing custom_id", {**line(), "custom_id": ""}, "missing_custom_id", "custom_id"),
    ("method", {**line(), "method": "PUT"}, "invalid_method", "method"),
    ("url", {**line(), "url": "/v1/embeddings"}, "mismatched_endpoint", "url"),
    ("body", {**line(), "body": []}, "invalid_body", "body"),
    ("model", line(model=None), "missing_model", "body.model"),
    ("message not object", line(messages=["hi"]), "invalid_messages", "body.messages"),
    (
        "content type",
        line(messages=[{"role": "user", "content": 5}]),
        "invalid_messages",
        "body.messages",
    ),
    ("max_tokens negative", line(max_tokens=-1), "invalid_max_tokens", "body.max_tokens"),
    ("max_tokens bool", line(max_tokens=True), "invalid_max_tokens", "body.max_tokens"),
    ("max_tokens float", line(max_tokens=1.5), "invalid_max_tokens", "body.max_tokens"),
    ("over class limit", line(max_tokens=4097), "max_tokens_too_large", "body.max_tokens"),
    # 16 bytes per token at most: 65,600 characters are at least 4,100 tokens.
    (
        "prompt certainly too long",
        line(messages=[{"role": "user", "content": "x" * 65_600}]),
        "request_too_long",
        "body.messages",
    ),
    ("stream", line(stream=True), "unsupported_parameter", "body.stream"),
    ("best_of", line(best_of=3), "unsupported_parameter", "body.n"),
]


@pytest.mark.parametrize(("label", "bad", "code", "param"), CASES, ids=[c[0] for c in CASES])
def test_each_problem_is_reported_with_its_line_code_and_param(
    label: str, bad: dict[str, Any] | str, code: str, param: str | None
) -> None:
    result = validate_batch_input(encode(line("ok"), bad), CHAT, LIMITS)
    assert isinstance(result, InvalidBatch), label
    (error,) = result.errors
    assert (error.code, error.line, error.param) == (code, 2, param)
    assert error.as_dict() == {"code": code, "message": error.message, "param": param, "line": 2}


def test_a_long_prompt_that_might_fit_is_left_to_the_exact_tokenizer() -> None:
    # 60,000 characters may be as few as 3,750 tokens: not certainly over 4,096 with 10 more.
    result = validate_batch_input(
        encode(line(messages=[{"role": "user", "content": "x" * 60_000}])), CHAT, LIMITS
    )
    assert isinstance(result, ValidatedBatch)


def test_the_model_must_be_the_same_on_every_line() -> None:
    result = validate_batch_input(encode(line("a"), line("b", model="n")), CHAT, LIMITS)
    assert isinstance(result, InvalidBatch)
    assert result.errors[0].code == "mismatched_model"


def test_errors_are_capped_and_the_rest_counted() -> None:
    lines = [line(f"x{i}", max_tokens=0) for i in range(MAX_REPORTED_ERRORS + 7)]
    result = validate_batch_input(encode(*lines), CHAT, LIMITS)
    assert isinstance(result, InvalidBatch)
    assert len(result.errors) == MAX_REPORTED_ERRORS + 1
    assert result.errors[-1].code == "too_many_errors"
    assert "7 more" in result.errors[-1].message


def test_an_empty_file_is_invalid() -> None:
    result = validate_batch_input(b"\n \n", CHAT, LIMITS)
    assert isinstance(result, InvalidBatch)
    assert result.errors[0].code == "empty_file"


def test_upload_checks_size_lines_and_line_length_cheaply() -> None:
    small = InputLimits(100, 30, 2, 4096, 16)
    assert check_upload(b'{"a": 1}\n{"b": 2}\n', small) == 2
    with pytest.raises(PayloadTooLarge):
        check_upload(b"x" * 101, small)
    with pytest.raises(InvalidRequest, match="line 2 is 31 bytes"):
        check_upload(b"{}\n" + b"x" * 31 + b"\n", small)
    with pytest.raises(InvalidRequest, match="more than 2 request lines"):
        check_upload(b"{}\n{}\n{}\n", small)


def _completion(custom_id: str, prompt: Any, max_tokens: int = 100, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": COMPLETIONS,
        "body": {"model": "m", "prompt": prompt, "max_tokens": max_tokens, **body},
    }


def test_every_prompt_of_a_line_is_charged_its_output_budget() -> None:
    result = validate_batch_input(
        encode(_completion("a", ["x"] * 20), _completion("b", "y")), COMPLETIONS, LIMITS
    )
    assert isinstance(result, ValidatedBatch)
    # 20 sequences of up to 100 tokens each, and one more: what quota and deadline judge.
    assert result.max_output_tokens == 21 * 100


def test_a_line_with_more_prompts_than_the_limit_is_refused() -> None:
    limits = dataclasses.replace(LIMITS, max_prompts_per_line=8)
    result = validate_batch_input(encode(_completion("a", ["x"] * 2000)), COMPLETIONS, limits)
    assert isinstance(result, InvalidBatch)
    assert (result.errors[0].code, result.errors[0].param) == ("too_many_prompts", "body.prompt")


def test_the_limit_check_judges_each_prompt_of_a_list_apart() -> None:
    # Each prompt is short; together they are far past what one sequence could hold.
    result = validate_batch_input(
        encode(_completion("a", ["x" * 30_000, "y" * 30_000, "z" * 30_000])), COMPLETIONS, LIMITS
    )
    assert isinstance(result, ValidatedBatch)
    too_long = validate_batch_input(
        encode(_completion("a", ["x", "y" * 70_000])), COMPLETIONS, LIMITS
    )
    assert isinstance(too_long, InvalidBatch)
    assert too_long.errors[0].code == "request_too_long"


def test_integral_numbers_are_stored_as_integers_and_strings_refused() -> None:
    result = validate_batch_input(
        encode(line("a", min_tokens=3.0, temperature=0.2, max_tokens=10.0)), CHAT, LIMITS
    )
    assert isinstance(result, ValidatedBatch)
    stored = json.loads(result.items[0].body)
    assert (stored["min_tokens"], stored["temperature"], stored["max_tokens"]) == (3, 0.2, 10)
    assert type(stored["max_tokens"]) is int
    assert result.items[0].max_output_tokens == 10
    bad = validate_batch_input(encode(line("a", min_tokens="3.0")), CHAT, LIMITS)
    assert isinstance(bad, InvalidBatch)
    assert (bad.errors[0].code, bad.errors[0].param) == ("invalid_parameter", "body.min_tokens")


def test_prompt_embeddings_are_refused_in_a_line() -> None:
    bad = validate_batch_input(
        encode(_completion("a", "x", prompt_embeds="AAAA")), COMPLETIONS, LIMITS
    )
    assert isinstance(bad, InvalidBatch)
    assert (bad.errors[0].code, bad.errors[0].param) == (
        "unsupported_parameter",
        "body.prompt_embeds",
    )


def test_a_tool_schema_counts_toward_the_forecast() -> None:
    plain = validate_batch_input(encode(line("a")), CHAT, LIMITS)
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 40_000}}]
    with_tools = validate_batch_input(encode(line("a", tools=tools)), CHAT, LIMITS)
    assert isinstance(plain, ValidatedBatch)
    assert isinstance(with_tools, ValidatedBatch)
    assert with_tools.estimated_prompt_tokens >= plain.estimated_prompt_tokens + 10_000


def test_an_item_points_at_its_body_only_where_the_bytes_read_back_as_it() -> None:
    line = (
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": '
        '{"model": "m", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 4}}'
    )

    def stored(raw: bytes) -> tuple[str | None, bytes | None]:
        located = LocatedLines([(raw, (3, 10, len(raw)))])
        result = validate_batch_input(located, CHAT, LIMITS)
        assert isinstance(result, ValidatedBatch), result
        item = result.items[0]
        if item.body is not None:
            return item.body, None
        assert item.body_seq == 3
        assert item.body_at is not None
        assert item.body_len is not None
        at = item.body_at - 10
        return None, raw[at : at + item.body_len]

    for pointed in (
        (line % "plain").encode(),
        (line % "caf\u00e9").encode(),
        (line % "\\ud83d\\ude00").encode(),  # a surrogate pair, escaped
        (line % "\\u0000").encode(),
        b"\xef\xbb\xbf" + (line % "bom").encode(),
        # The body not last: found where it is, verified by reading it back.
        b'{"custom_id": "a", "body": {"model": "m", "messages": [{"role": "user", '
        b'"content": "x"}], "max_tokens": 4, "metadata": {"body": {"x": 1}}}, '
        b'"method": "POST", "url": "/v1/chat/completions"}',
    ):
        body, span = stored(pointed)
        assert body is None, pointed
        assert span is not None
        assert json.loads(span) == json.loads(pointed.decode("utf-8-sig"))["body"]
    # Not UTF-8 (Python reads it; Postgres' text cannot hold it): the item keeps a copy.
    raw = (line % "\ud800").encode("utf-8", "surrogatepass")
    assert stored(raw)[0] is not None


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


@given(value=JSON_VALUES, ascii_only=st.booleans())
def test_the_fast_parser_reads_every_line_as_json_does(value: Any, ascii_only: bool) -> None:
    raw = json.dumps(value, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    assert _loads(raw) == json.loads(raw)


@pytest.mark.parametrize(
    "raw",
    [
        b'{"a": 1, "a": 2}',
        b'{"a": 1e400, "b": -0.0, "c": 123456789012345678901234567890}',
        b'{"a": "\\ud800"}',
        b"\xef\xbb\xbf{}",
        b"[" * 500 + b"]" * 500,
        b'{"a": "\\u0000"}',
    ],
)
def test_what_the_fast_parser_refuses_the_reference_parser_judges(raw: bytes) -> None:
    assert repr(_loads(raw)) == repr(json.loads(raw))


def test_nan_is_refused_with_json_s_words() -> None:
    with pytest.raises(ValueError, match="NaN is not valid JSON"):
        _loads(b'{"a": NaN}')


def test_the_stream_names_every_bad_line_in_its_one_pass_as_validation_does() -> None:
    # An ingest streams a file into its COPY once: at the first bad line it stops storing,
    # checks the rest, and reports what a second, whole validation would (no second pass).
    content = encode(line("a"), line("b", max_tokens=-1), line("c"), "{not json", line("e"))
    lines = [raw for raw in content.split(b"\n") if raw]
    stored = []
    with pytest.raises(LineInvalid) as raised:
        stored.extend(stream_valid_items(iter(lines), CHAT, LIMITS, Tally()))
    assert [i.custom_id for i in stored] == ["a"]
    whole = validate_batch_input(content, CHAT, LIMITS)
    assert isinstance(whole, InvalidBatch)
    assert [(e.line, e.code) for e in raised.value.errors] == [
        (e.line, e.code) for e in whole.errors
    ]
    assert [e.line for e in raised.value.errors] == [2, 4]
