"""Responses batches (``/v1/responses``): every line checked strictly before anything is
stored, and counted as the chat prompt vLLM renders from ``instructions``, ``input`` and
``tools`` (pure, no services; the e2e test holds the counts to the real engine's usage)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from backfill.batch_input import (
    InvalidBatch,
    ValidatedBatch,
    forecast_tokens_upper_bound,
    validate_batch_input,
)
from backfill.prefill import RESPONSES, prefill_plan
from backfill.refusals import InvalidRequest
from backfill.responses import check_responses_body, responses_chat
from tests.unit.dispatch_builders import claimed
from tests.unit.support_limits import BATCH_LIMITS
from worker.engine import ResumeUnsupported, resumable, resume_request
from worker.prepare import run_plan

LIMITS = dataclasses.replace(BATCH_LIMITS, max_sequence_tokens=512, default_max_tokens=64)


def line(custom_id: str = "a", url: str = RESPONSES, **body: Any) -> dict[str, Any]:
    full: dict[str, Any] = {"model": "m", "input": "hello", "max_output_tokens": 16}
    full.update(body)
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": full}


def encode(*lines: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(x).encode() + b"\n" for x in lines)


def validated(*lines: dict[str, Any]) -> ValidatedBatch:
    result = validate_batch_input(encode(*lines), RESPONSES, LIMITS)
    assert isinstance(result, ValidatedBatch), result
    return result


def errors_of(*lines: dict[str, Any]) -> list[tuple[str, str | None, str]]:
    result = validate_batch_input(encode(*lines), RESPONSES, LIMITS)
    assert isinstance(result, InvalidBatch)
    return [(e.code, e.param, e.message) for e in result.errors]


def stored(item_body: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(item_body)
    return body


def test_string_and_item_inputs_are_accepted_with_their_output_budget() -> None:
    result = validated(
        line("s", input="a question"),
        line(
            "items",
            instructions="Be brief.",
            input=[
                {"role": "user", "content": "hi"},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "x"}],
                },
                {"role": "assistant", "content": "hello"},
                {"type": "message", "role": "developer", "content": "rules"},
            ],
            temperature=0,
            top_p=0.5,
            text={"format": {"type": "text"}},
            metadata={"k": "v"},
            max_output_tokens=32.0,
        ),
    )
    assert [i.max_output_tokens for i in result.items] == [16, 32]
    assert result.max_output_tokens == 48
    assert stored(result.items[1].body)["max_output_tokens"] == 32  # 32.0 stored as 32


def test_a_line_without_max_output_tokens_gets_the_default_written_in() -> None:
    bare = line()
    del bare["body"]["max_output_tokens"]
    result = validated(bare, line("null", max_output_tokens=None))
    assert [i.max_output_tokens for i in result.items] == [64, 64]
    assert stored(result.items[0].body)["max_output_tokens"] == 64
    assert stored(result.items[1].body)["max_output_tokens"] == 64


def test_store_is_written_false_and_a_true_store_is_refused() -> None:
    result = validated(line(), line("f", store=False))
    assert [stored(i.body)["store"] for i in result.items] == [False, False]
    [(code, param, message)] = errors_of(line(store=True))
    assert (code, param) == ("unsupported_parameter", "body.store")
    assert "output file" in message


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("stream", True, "stream is not supported"),
        ("background", True, "background is not supported"),
        ("previous_response_id", "resp_1", "stateless"),
        ("conversation", "conv_1", "stateless"),
        ("prompt", {"id": "p"}, "prompt templates"),
        ("priority", 3, "Backfill sets"),
        ("request_id", "x", "Backfill sets"),
        ("max_tokens", 5, "not a parameter of /v1/responses"),
        ("messages", [], "not a parameter of /v1/responses"),
    ],
)
def test_fields_a_batch_line_cannot_honour_are_line_errors_naming_them(
    field: str, value: Any, says: str
) -> None:
    [(code, param, message)] = errors_of(line(**{field: value}))
    assert code == "unsupported_parameter"
    assert param == f"body.{field}"
    assert says in message


def test_false_stream_and_background_are_accepted() -> None:
    validated(line(stream=False, background=False))


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": ""}, "body.input", "must not be empty"),
        ({"input": []}, "body.input", "non-empty"),
        ({"input": [{"role": "robot", "content": "x"}]}, "body.input", "role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "body.input",
            "images, files, audio and refusals",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "body.input", "'reasoning' item"),
        (
            # Without its type vLLM does not take an assistant's parts for an output message.
            {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]},
            "body.input",
            "must be of type 'message'",
        ),
        (
            {"input": [{"role": "assistant", "content": "so far", "status": "incomplete"}]},
            "body.input",
            "status is taken only on an assistant message of type 'message'",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]},
            "body.input",
            "must be an input_text part",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "body.input", "'item_reference'"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]},
            "body.input",
            "cannot be counted exactly",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]},
            "body.input",
            "cannot be counted exactly",
        ),
        ({"tools": [{"type": "web_search"}]}, "body.tools", "function tools only"),
        ({"tools": [{"type": "function"}]}, "body.tools", "name"),
        ({"max_output_tokens": 0}, "body.max_output_tokens", "positive integer"),
        ({"max_output_tokens": "8"}, "body.max_output_tokens", "positive integer"),
        ({"max_output_tokens": 513}, "body.max_output_tokens", "exceeds the batch limit"),
        ({"temperature": "hot"}, "body.temperature", "finite number"),
        ({"instructions": 3}, "body.instructions", "string"),
    ],
)
def test_bad_inputs_tools_and_budgets_are_line_errors(
    body: dict[str, Any], param: str, says: str
) -> None:
    [(_, got_param, message)] = errors_of(line(**body))
    assert got_param == param
    assert says in message


def test_the_class_limit_lower_bound_counts_instructions_and_input() -> None:
    # 16 bytes per token at most: 8,000 characters are at least 500 tokens.
    [(code, param, message)] = errors_of(
        line(instructions="x" * 4000, input="y" * 4000, max_output_tokens=16)
    )
    assert (code, param) == ("request_too_long", "body.input")
    assert "at least 500 tokens" in message


def test_a_long_input_without_max_output_tokens_gets_what_the_limit_leaves() -> None:
    # Never refused for the default: 7,200 characters are at least 450 tokens, which leave
    # 62 of the limit of 512, less than the default of 64.
    bare = line(input="y" * 7200)
    del bare["body"]["max_output_tokens"]
    given = line("b", input="y" * 7200, max_output_tokens=64)
    [(code, param, message)] = errors_of(given)
    assert (code, param) == ("request_too_long", "body.input")
    assert "with max_output_tokens 64" in message
    [item] = validated(bare).items
    assert (item.max_output_tokens, item.output_defaulted) == (512 - 450, True)
    assert stored(item.body or "")["max_output_tokens"] == 512 - 450


def test_an_input_that_alone_fills_the_limit_is_refused_without_max_output_tokens() -> None:
    bare = line(input="y" * 16 * 512)
    del bare["body"]["max_output_tokens"]
    [(code, param, message)] = errors_of(bare)
    assert (code, param) == ("request_too_long", "body.input")
    assert "at least 512 tokens; it leaves no room for output" in message


def test_the_prompt_is_counted_as_vllm_renders_it_a_chat_prompt() -> None:
    body: dict[str, Any] = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "2+2?"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is 4."}],
            },
        ],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
        "reasoning": {"effort": "low"},
        "temperature": 0,
    }
    plan = prefill_plan(RESPONSES, body)
    assert (plan.known, plan.n) == ((), 1)
    [tokenize] = plan.tokenize
    assert tokenize["messages"] == [
        {"role": "system", "content": "Be brief."},
        # /tokenize takes chat parts, which vLLM's renderer reads input_text parts as.
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        # An assistant's output message renders its text.
        {"role": "assistant", "content": "It is 4."},
    ]
    assert tokenize["tools"] == [
        {
            "type": "function",
            "function": {"name": "add", "description": None, "parameters": {"type": "object"}},
        }
    ]
    assert tokenize["add_generation_prompt"] is True
    assert tokenize["continue_final_message"] is False
    # reasoning.effort renders as the chat endpoint renders reasoning_effort.
    assert tokenize["chat_template_kwargs"] == {"reasoning_effort": "low", "enable_thinking": True}


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    chat = responses_chat({"input": "hi", "instructions": "sys"})
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    assert "tools" not in chat


def test_function_call_items_are_refused_since_tokenize_reorders_their_fields() -> None:
    # vLLM renders a Responses function call as {"name", "arguments"}; /tokenize validates
    # a chat tool call into {"arguments", "name"}: a template writing it as JSON differs (a
    # token more in the e2e test's ChatML template), so the count could fall short.
    with pytest.raises(InvalidRequest, match="cannot be counted exactly") as refused:
        responses_chat(
            {
                "input": [
                    {"role": "user", "content": "q"},
                    {"type": "function_call", "call_id": "a", "name": "f", "arguments": "1"},
                ]
            }
        )
    assert refused.value.code == "unsupported_parameter"


def test_a_final_item_left_incomplete_is_continued_without_a_generation_prompt() -> None:
    chat = responses_chat(
        {
            "input": [
                {"role": "user", "content": "q"},
                {
                    "type": "message",
                    "role": "assistant",
                    "status": "incomplete",
                    "content": [{"type": "output_text", "text": "The answer"}],
                },
            ]
        }
    )
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)


def test_the_check_leaves_a_clean_body_alone_but_for_store() -> None:
    body: dict[str, Any] = {"model": "m", "input": "x", "max_output_tokens": 3}
    assert check_responses_body(body) is None
    assert body == {"model": "m", "input": "x", "max_output_tokens": 3, "store": False}


def test_an_uncountable_input_is_refused_by_the_count_itself() -> None:
    with pytest.raises(InvalidRequest, match="custom_tool_call_output"):
        prefill_plan(RESPONSES, {"input": [{"type": "custom_tool_call_output"}]})


def test_forecasts_charge_max_output_tokens() -> None:
    content = encode(line(max_output_tokens=400))
    assert forecast_tokens_upper_bound(content) >= 400


def test_a_preempted_responses_item_is_not_resumed() -> None:
    assert not resumable(RESPONSES)
    assert resumable("/v1/chat/completions")
    with pytest.raises(ResumeUnsupported):
        resume_request(RESPONSES, {"input": "x", "max_output_tokens": 8}, "partial", 3)


def test_a_preempted_responses_item_runs_again_whole_even_past_its_budget() -> None:
    body = {"model": "m", "input": "x", "max_output_tokens": 8}
    for done in (3, 8):
        item = claimed(
            body=json.dumps(body),
            endpoint=RESPONSES,
            max_output_tokens=8,
            partial_tokens=done,
            partial_output="partial",
        )
        plan = run_plan(item)
        assert (plan.request, plan.kept, plan.complete) == (body, 0, False)
