"""Embeddings batches (``/v1/embeddings``): every line checked strictly before anything is
stored, counted one sequence per input, reserved on its prompt alone (pure, no services)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from backfill.batch_input import InvalidBatch, ValidatedBatch, validate_batch_input
from backfill.ledger import ReserveRequest
from backfill.policy import ServiceClass
from backfill.prefill import EMBEDDINGS, PromptCount, prefill_plan
from backfill.refusals import InvalidRequest
from backfill.reservations import reservation_tokens
from tests.unit.support_limits import BATCH_LIMITS

LIMITS = dataclasses.replace(BATCH_LIMITS, max_sequence_tokens=512, max_prompts_per_line=8)


def line(custom_id: str = "a", url: str = EMBEDDINGS, **body: Any) -> dict[str, Any]:
    full: dict[str, Any] = {"model": "m", "input": "hello"}
    full.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": full}


def encode(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def errors_of(*lines: dict[str, Any]) -> list[tuple[str, str | None, str]]:
    result = validate_batch_input(encode(*lines), EMBEDDINGS, LIMITS)
    assert isinstance(result, InvalidBatch)
    return [(e.code, e.param, e.message) for e in result.errors]


def test_the_four_input_forms_of_openai_are_accepted_and_declare_no_output() -> None:
    result = validate_batch_input(
        encode(
            line("s", input="a sentence"),
            line("ss", input=["one", "two"]),
            line("t", input=[1, 2, 3]),
            line("tt", input=[[1, 2], [3]]),
            line("opts", encoding_format="base64", dimensions=8.0, user="u"),
        ),
        EMBEDDINGS,
        LIMITS,
    )
    assert isinstance(result, ValidatedBatch)
    assert [i.custom_id for i in result.items] == ["s", "ss", "t", "tt", "opts"]
    assert [i.max_output_tokens for i in result.items] == [0] * 5
    assert result.max_output_tokens == 0
    assert result.model == "m"
    stored = json.loads(result.items[4].body)
    assert stored["dimensions"] == 8
    assert type(stored["dimensions"]) is int
    # Nothing is added to the body: no max_tokens default for an endpoint that generates none.
    assert "max_tokens" not in json.loads(result.items[0].body)


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"input": ""}, "invalid_input", "body.input"),
        ({"input": []}, "invalid_input", "body.input"),
        ({"input": ["a", ""]}, "invalid_input", "body.input"),
        ({"input": ["a", [1]]}, "invalid_input", "body.input"),
        ({"input": [[1], []]}, "invalid_input", "body.input"),
        ({"input": [1, -2]}, "invalid_input", "body.input"),
        ({"input": {"text": "x"}}, "invalid_input", "body.input"),
        # vLLM's chat-message forms are not OpenAI's, and /tokenize does not count them so.
        ({"input": [{"role": "user", "content": "x"}]}, "invalid_input", "body.input"),
        ({"input": None}, "invalid_input", "body.input"),
        ({"max_tokens": 16}, "unsupported_parameter", "body.max_tokens"),
        ({"stream": True}, "unsupported_parameter", "body.stream"),
        ({"n": 2}, "unsupported_parameter", "body.n"),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            "unsupported_parameter",
            "body.messages",
        ),
        ({"padding": "max_length"}, "unsupported_parameter", "body.padding"),
        ({"priority": -5}, "unsupported_parameter", "body.priority"),
        ({"encoding_format": "bytes"}, "invalid_parameter", "body.encoding_format"),
        ({"dimensions": 0}, "invalid_parameter", "body.dimensions"),
        ({"dimensions": "8"}, "invalid_parameter", "body.dimensions"),
        ({"dimensions": True}, "invalid_parameter", "body.dimensions"),
        ({"truncate_prompt_tokens": 0}, "invalid_parameter", "body.truncate_prompt_tokens"),
        ({"add_special_tokens": "false"}, "invalid_parameter", "body.add_special_tokens"),
        ({"user": 7}, "invalid_parameter", "body.user"),
    ],
)
def test_each_problem_is_a_line_error_naming_its_field(
    body: dict[str, Any], code: str, param: str
) -> None:
    ((got_code, got_param, message),) = errors_of(line("ok"), line("bad", **body))
    assert (got_code, got_param) == (code, param), message


def test_a_missing_input_and_a_missing_model_are_named() -> None:
    bare = line("a")
    del bare["body"]["input"]
    nameless = line("b")
    del nameless["body"]["model"]
    assert [(c, p) for c, p, _ in errors_of(bare, nameless)] == [
        ("missing_prompt", "body.input"),
        ("missing_model", "body.model"),
    ]


def test_a_line_must_target_the_batch_endpoint() -> None:
    ((code, param, message),) = errors_of(line("a", url="/v1/completions"))
    assert (code, param) == ("mismatched_endpoint", "url")
    assert "/v1/embeddings" in message


def test_an_unknown_field_is_refused_naming_what_a_line_may_give() -> None:
    ((_, _, message),) = errors_of(line("a", temperature=0.5))
    assert message.startswith("body.temperature is not a parameter of /v1/embeddings")
    assert "encoding_format" in message
    assert "dimensions" in message


def test_more_inputs_than_a_line_may_hold_are_refused() -> None:
    ((code, param, _),) = errors_of(line("a", input=["x"] * (LIMITS.max_prompts_per_line + 1)))
    assert (code, param) == ("too_many_prompts", "body.input")


def test_the_class_limit_judges_each_input_apart() -> None:
    # Each input is a sequence of its own: many short inputs pass, one long one cannot.
    per_token = LIMITS.max_bytes_per_token
    short = ["y" * per_token * 100] * 8
    long = "x" * per_token * (LIMITS.max_sequence_tokens + 1)
    assert isinstance(
        validate_batch_input(encode(line("a", input=short)), EMBEDDINGS, LIMITS), ValidatedBatch
    )
    ((code, param, _),) = errors_of(line("b", input=long))
    assert (code, param) == ("request_too_long", "body.input")


def test_inputs_are_counted_one_sequence_each_with_token_ids_known() -> None:
    plan = prefill_plan(EMBEDDINGS, {"input": ["ab", "cde"], "add_special_tokens": False})
    assert plan.tokenize == (
        {"prompt": "ab", "add_special_tokens": False},
        {"prompt": "cde", "add_special_tokens": False},
    )
    assert (plan.known, plan.sequences) == ((), 2)
    ids = prefill_plan(EMBEDDINGS, {"input": [[1, 2, 3], [4]]})
    assert (ids.tokenize, ids.known, ids.sequences) == ((), (3, 1), 2)
    single = prefill_plan(EMBEDDINGS, {"input": "one"})
    assert (single.tokenize, single.sequences) == (({"prompt": "one"},), 1)


@pytest.mark.parametrize(
    "body",
    [
        {"input": "x", "messages": [{"role": "user", "content": "x"}]},
        {"input": "x", "padding": "max_length"},
        {"input": [{"role": "user", "content": "x"}]},
    ],
)
def test_what_the_worker_cannot_count_is_refused_there_too(body: dict[str, Any]) -> None:
    # The worker plans every count through prefill_plan: a body that slipped past creation
    # is refused before any engine work.
    with pytest.raises(InvalidRequest):
        prefill_plan(EMBEDDINGS, body)


def test_an_embedding_reserves_its_prompt_alone_in_whole_blocks_per_input() -> None:
    block = 16
    # 16 prompt tokens are exactly one block: no output token pushes it into a second.
    assert reservation_tokens(16, 0, block) == 16
    assert reservation_tokens(17, 0, block) == 32
    # Three inputs, the longest 20 tokens: each charged two blocks.
    count = PromptCount.of([20, 5, 9])
    assert reservation_tokens(count.longest, 0, block, count.sequences) == 3 * 32
    # The ledger takes such a request; a request of nothing at all is still refused.
    ReserveRequest("n", ServiceClass.BATCH, 16, 0)
    with pytest.raises(ValueError, match="need"):
        ReserveRequest("n", ServiceClass.BATCH, 0, 0)
    with pytest.raises(ValueError, match="need"):
        reservation_tokens(0, 0, block)


def test_a_batch_holds_at_most_openais_number_of_inputs() -> None:
    assert LIMITS.max_embedding_inputs == 50_000  # OpenAI's, across the batch's lines
    limits = dataclasses.replace(LIMITS, max_embedding_inputs=5)
    two_and_three = encode(line("a", input=["x", "y"]), line("b", input=["x", "y", "z"]))
    assert isinstance(validate_batch_input(two_and_three, EMBEDDINGS, limits), ValidatedBatch)
    over = validate_batch_input(
        encode(line("a", input=["x"] * 3), line("b", input=["x"] * 3)), EMBEDDINGS, limits
    )
    assert isinstance(over, InvalidBatch)
    ((code, param, message),) = [(e.code, e.param, e.message) for e in over.errors]
    assert (code, param) == ("too_many_inputs", "input_file_id")
    assert "6 embedding inputs" in message
