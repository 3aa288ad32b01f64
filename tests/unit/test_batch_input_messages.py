"""The words of a batch input file's refusals, pinned: one bad line per rule, on each endpoint
the file serves, every error compared whole (line, code, param, message). Clients and docs
quote these messages; a refactor of the checks must leave every one byte-identical (pure, no
services)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from backfill.batch_input import (
    InputLimits,
    InvalidBatch,
    LineInvalid,
    Tally,
    stream_valid_items,
    validate_batch_input,
)
from backfill.content_parts import MediaPolicy
from backfill.prefill import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES
from tests.unit.support_limits import BATCH_LIMITS

LIMITS = dataclasses.replace(BATCH_LIMITS, max_file_bytes=100_000_000)
LONG = "x" * 65_800
"""At least 4,113 tokens: past the limit of 4,096 whatever the budget."""
FULL = "y" * 65_536
"""At least 4,096 tokens: the whole limit, no room for output."""
MESSAGES = [{"role": "user", "content": "hello"}]


def request(custom_id: str, url: str, body: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body} | fields


def chat(custom_id: str, **body: Any) -> dict[str, Any]:
    full = {"model": "m", "messages": MESSAGES, "max_tokens": 10} | body
    return request(custom_id, CHAT, {k: v for k, v in full.items() if v is not ...})


def completion(custom_id: str, **body: Any) -> dict[str, Any]:
    full = {"model": "m", "prompt": "hello", "max_tokens": 10} | body
    return request(custom_id, COMPLETIONS, {k: v for k, v in full.items() if v is not ...})


def embedding(custom_id: str, **body: Any) -> dict[str, Any]:
    full = {"model": "m", "input": "hello"} | body
    return request(custom_id, EMBEDDINGS, {k: v for k, v in full.items() if v is not ...})


def response(custom_id: str, **body: Any) -> dict[str, Any]:
    full = {"model": "m", "input": "hello", "max_output_tokens": 16} | body
    return request(custom_id, RESPONSES, {k: v for k, v in full.items() if v is not ...})


def errors_of(
    endpoint: str, *lines: dict[str, Any] | str, limits: InputLimits = LIMITS
) -> list[tuple[Any, ...]]:
    content = b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)
    result = validate_batch_input(content, endpoint, limits)
    assert isinstance(result, InvalidBatch), result
    return [(e.line, e.code, e.param, e.message) for e in result.errors]


def test_the_envelope_and_chat_refusals_keep_their_words() -> None:
    assert errors_of(
        CHAT,
        chat("ok"),
        "not json",
        chat("huge", messages=[{"role": "user", "content": "z" * 100_001}]),
        "[1, 2]",
        request("", CHAT, {}),
        chat("c" * 513),
        chat("nul\x00"),
        chat("ok"),
        chat("meth") | {"method": "GET"},
        chat("url") | {"url": COMPLETIONS},
        chat("body") | {"body": [1]},
        chat("model", model=""),
        chat("model2", model="other"),
        chat("nomsg", messages=...),
        chat("msgs", messages=[]),
        chat("role", messages=[{"content": "x"}]),
        chat("content", messages=[{"role": "user", "content": 5}]),
        chat("temp", temperature="hot"),
        chat("mt", max_tokens="ten"),
        chat("mt0", max_tokens=0),
        chat("mct", max_completion_tokens=-1),
        chat("stream", stream=True),
        chat("n", n=2),
        chat("bestof", best_of=3),
        chat("big", max_tokens=5000),
        chat("long", messages=[{"role": "user", "content": LONG}], max_tokens=100),
        chat("full", messages=[{"role": "user", "content": FULL}], max_tokens=...),
    ) == [
        (2, "invalid_json_line", None,
         "line is not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        (3, "line_too_long", None, "line is 100160 bytes; the limit is 100000"),
        (4, "invalid_json_line", None, "line must be a JSON object"),
        (5, "missing_custom_id", "custom_id", "custom_id must be a non-empty string"),
        (6, "invalid_custom_id", "custom_id", "custom_id is longer than 512 characters"),
        (7, "invalid_custom_id", "custom_id", "custom_id must not contain NUL (\\u0000)"),
        (8, "duplicate_custom_id", "custom_id",
         "custom_id 'ok' appears more than once in the file"),
        (9, "invalid_method", "method", "method must be 'POST'"),
        (10, "mismatched_endpoint", "url",
         "url '/v1/completions' does not match the batch's endpoint '/v1/chat/completions'"),
        (11, "invalid_body", "body", "body must be a JSON object"),
        (12, "missing_model", "body.model", "body.model must be a non-empty string"),
        (13, "mismatched_model", "body.model",
         "body.model 'other' differs from 'm': a batch runs one model"),
        (14, "missing_prompt", "body.messages",
         "body.messages is required for /v1/chat/completions"),
        (15, "invalid_messages", "body.messages",
         "body.messages must be a non-empty array of message objects"),
        (16, "invalid_messages", "body.messages",
         "body.messages[0] must be an object with a string 'role'"),
        (17, "invalid_messages", "body.messages",
         "body.messages[0].content must be a string, an array or null"),
        (18, "invalid_parameter", "body.temperature",
         "body.temperature must be a finite number (got str)"),
        (19, "invalid_max_tokens", "body.max_tokens",
         "body.max_tokens must be an integer (got str)"),
        (20, "invalid_max_tokens", "body.max_tokens", "max_tokens must be a positive integer"),
        (21, "invalid_max_tokens", "body.max_tokens", "max_tokens must be a positive integer"),
        (22, "unsupported_parameter", "body.stream", "stream is not supported in batches"),
        (23, "unsupported_parameter", "body.n", "n and best_of must be 1 in batches"),
        (24, "unsupported_parameter", "body.n", "n and best_of must be 1 in batches"),
        (25, "max_tokens_too_large", "body.max_tokens",
         "max_tokens 5000 exceeds the batch limit of 4096 tokens per sequence"),
        (26, "request_too_long", "body.messages",
         "the prompt is at least 4113 tokens; with max_tokens 100 it exceeds the batch limit "
         "of 4096"),
        (27, "request_too_long", "body.messages",
         "the prompt is at least 4096 tokens; it leaves no room for output within the batch "
         "limit of 4096 tokens per sequence"),
    ]  # fmt: skip


def test_the_completions_refusals_keep_their_words() -> None:
    assert errors_of(
        COMPLETIONS,
        completion("ok"),
        completion("noprompt", prompt=...),
        completion("empty", prompt=""),
        completion("emptyin", prompt=["a", ""]),
        completion("many", prompt=["a"] * 65),
        completion("bad", prompt=5),
        completion("both", max_completion_tokens=5),
        completion("stream", stream=1),
        completion("embeds", prompt_embeds="AAAA"),
        completion("big", max_tokens=5000),
        completion("long", prompt=LONG, max_tokens=100),
        completion("long2", prompt=[LONG, "a"], max_tokens=100),
    ) == [
        (2, "missing_prompt", "body.prompt", "body.prompt is required for /v1/completions"),
        (3, "invalid_prompt", "body.prompt", "body.prompt must not be empty"),
        (4, "invalid_prompt", "body.prompt", "body.prompt must not hold an empty prompt"),
        (5, "too_many_prompts", "body.prompt",
         "body.prompt holds 65 prompts; a line may hold at most 64 (each runs as a sequence of "
         "its own: put the rest on lines of their own)"),
        (6, "invalid_prompt", "body.prompt",
         "prompt must be a string, an array of strings, an array of token ids, or an array of "
         "arrays of token ids"),
        (7, "invalid_parameter", "body.max_completion_tokens",
         "a /v1/completions line takes max_tokens; max_completion_tokens is a chat field (give "
         "max_tokens alone)"),
        (8, "unsupported_parameter", "body.stream", "stream is not supported in batches"),
        (9, "unsupported_parameter", "body.prompt_embeds",
         "prompt_embeds is not supported: Backfill reserves KV for the prompt it can count"),
        (10, "max_tokens_too_large", "body.max_tokens",
         "max_tokens 5000 exceeds the batch limit of 4096 tokens per sequence"),
        (11, "request_too_long", "body.prompt",
         "the prompt is at least 4113 tokens; with max_tokens 100 it exceeds the batch limit "
         "of 4096"),
        (12, "request_too_long", "body.prompt",
         "the prompt is at least 4113 tokens; with max_tokens 100 it exceeds the batch limit "
         "of 4096"),
    ]  # fmt: skip


def test_the_embeddings_refusals_keep_their_words() -> None:
    errors = errors_of(
        EMBEDDINGS,
        embedding("ok"),
        embedding("noinput", input=...),
        embedding("empty", input=""),
        embedding("emptyin", input=["a", ""]),
        embedding("many", input=["a"] * 65),
        embedding("bad", input=5.5),
        embedding("fmt", encoding_format="png"),
        embedding("extra", max_tokens=5),
        embedding("long", input=LONG),
    )
    assert errors[6][:3] == (8, "unsupported_parameter", "body.max_tokens")
    assert errors[6][3].startswith(
        "body.max_tokens is not a parameter of /v1/embeddings in a batch; a line may give model"
    )
    del errors[6]
    assert errors == [
        (2, "missing_prompt", "body.input", "body.input is required for /v1/embeddings"),
        (3, "invalid_input", "body.input", "body.input must not be empty"),
        (4, "invalid_input", "body.input", "body.input must not hold an empty input"),
        (5, "too_many_prompts", "body.input",
         "body.input holds 65 prompts; a line may hold at most 64 (each runs as a sequence of "
         "its own: put the rest on lines of their own)"),
        (6, "invalid_input", "body.input",
         "input must be a string, an array of strings, an array of token ids, or an array of "
         "arrays of token ids"),
        (7, "invalid_parameter", "body.encoding_format",
         "body.encoding_format must be one of 'float', 'base64'"),
        (9, "request_too_long", "body.input",
         "an input is at least 4113 tokens; it exceeds the batch limit of 4096"),
    ]  # fmt: skip


def test_the_responses_refusals_keep_their_words() -> None:
    errors = errors_of(
        RESPONSES,
        response("ok"),
        response("mot", max_output_tokens=0),
        response("mot2", max_output_tokens="x"),
        response("big", max_output_tokens=5000),
        response("long", input=LONG, max_output_tokens=100),
        response("full", input=FULL, max_output_tokens=...),
        response("stream", stream=True),
        response("unknown", frobnicate=1),
        response("noinput", input=None),
        response("url") | {"url": CHAT},
    )
    assert errors[6][:3] == (8, "unsupported_parameter", "body.frobnicate")
    assert errors[6][3].startswith(
        "body.frobnicate is not a parameter of /v1/responses in a batch; a line may give model"
    )
    del errors[6]
    assert errors == [
        (2, "invalid_max_tokens", "body.max_output_tokens",
         "body.max_output_tokens must be a positive integer"),
        (3, "invalid_max_tokens", "body.max_output_tokens",
         "body.max_output_tokens must be a positive integer"),
        (4, "max_tokens_too_large", "body.max_output_tokens",
         "max_output_tokens 5000 exceeds the batch limit of 4096 tokens per sequence"),
        (5, "request_too_long", "body.input",
         "the prompt is at least 4113 tokens; with max_output_tokens 100 it exceeds the batch "
         "limit of 4096"),
        (6, "request_too_long", "body.input",
         "the prompt is at least 4096 tokens; it leaves no room for output within the batch "
         "limit of 4096 tokens per sequence"),
        (7, "unsupported_parameter", "body.stream",
         "stream is not supported in batches: the result is a line of the output file"),
        (9, "invalid_input", "body.input",
         "body.input must be a non-empty string or a non-empty array of input items"),
        (10, "mismatched_endpoint", "url",
         "url '/v1/chat/completions' does not match the batch's endpoint '/v1/responses'"),
    ]  # fmt: skip


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES])
def test_a_file_without_request_lines_keeps_its_words(endpoint: str) -> None:
    assert errors_of(endpoint, " ") == [
        (None, "empty_file", "input_file_id", "file has no request lines")
    ]


def test_the_refusals_of_the_shared_field_rules_keep_their_words_on_every_endpoint() -> None:
    """The rules a checker borrows (JSON depth, flags, numbers, budgets) and the Responses
    body's own, each reached once: a refusal no test reached could change words unseen."""
    assert errors_of(
        CHAT,
        chat("ok"),
        "[" * 5000,
        chat("lp", logprobs="yes"),
        chat("agp", add_generation_prompt="yes"),
    ) == [
        (2, "invalid_json_line", None, "line is not valid JSON: JSON nested too deeply"),
        (3, "invalid_parameter", "body.logprobs", "body.logprobs must be true or false"),
        (4, "invalid_parameter", "body.add_generation_prompt",
         "body.add_generation_prompt must be true or false"),
    ]  # fmt: skip
    assert errors_of(
        COMPLETIONS,
        completion("ok"),
        completion("temp", temperature="hot"),
        completion("lp", logprobs=True),
        completion("mt0", max_tokens=0),
        completion("mt", max_tokens="ten"),
    ) == [
        (2, "invalid_parameter", "body.temperature",
         "body.temperature must be a finite number (got str)"),
        (3, "invalid_parameter", "body.logprobs", "body.logprobs must be an integer (got bool)"),
        (4, "invalid_max_tokens", "body.max_tokens", "max_tokens must be a positive integer"),
        (5, "invalid_max_tokens", "body.max_tokens",
         "body.max_tokens must be an integer (got str)"),
    ]  # fmt: skip
    assert errors_of(
        RESPONSES,
        response("ok"),
        response("bg", background="yes"),
        response("ptc", parallel_tool_calls="yes"),
        response("md", metadata=[1]),
        response("tools", tools={}),
        response("params", tools=[{"type": "function", "name": "f", "parameters": [1]}]),
        response("item", input=[1]),
        response("content", input=[{"role": "user", "content": []}]),
    ) == [
        (2, "invalid_parameter", "body.background", "body.background must be true or false"),
        (3, "invalid_parameter", "body.parallel_tool_calls",
         "body.parallel_tool_calls must be true or false"),
        (4, "invalid_parameter", "body.metadata", "body.metadata must be an object"),
        (5, "invalid_input", "body.tools", "body.tools must be an array"),
        (6, "invalid_input", "body.tools", "body.tools[0].parameters must be an object"),
        (7, "invalid_input", "body.input", "body.input[0] must be an object"),
        (8, "invalid_input", "body.input",
         "body.input[0].content must be a string or a non-empty array of text parts"),
    ]  # fmt: skip


def test_a_media_url_that_does_not_parse_keeps_its_words() -> None:
    media = MediaPolicy(allowed=True, domains=frozenset({"images.example.com"}))
    part = {"type": "image_url", "image_url": {"url": "http://[::1/x.png"}}
    assert errors_of(
        CHAT,
        chat("url", messages=[{"role": "user", "content": [part]}]),
        limits=dataclasses.replace(LIMITS, media=media),
    ) == [
        (1, "invalid_messages", "body.messages",
         "body.messages[0].content[0].image_url.url is not a valid URL"),
    ]  # fmt: skip


def test_too_many_lines_keeps_its_words() -> None:
    assert errors_of(
        CHAT, chat("a"), chat("b"), chat("c"), limits=dataclasses.replace(LIMITS, max_lines=2)
    ) == [(None, "too_many_lines", "input_file_id", "file has 3 request lines; the limit is 2")]


def test_a_streamed_file_without_request_lines_keeps_its_words() -> None:
    with pytest.raises(LineInvalid) as raised:
        list(stream_valid_items([b" "], CHAT, LIMITS, Tally()))
    assert [(e.line, e.code, e.param, e.message) for e in raised.value.errors] == [
        (None, "empty_file", "input_file_id", "file has no request lines")
    ]


NAMES_FIRST_FAULT = """
import json, sys
from backfill.batch_input import InputLimits, validate_batch_input
from backfill.prefill import CHAT, COMPLETIONS
limits = InputLimits(*json.loads(sys.argv[1]))
integers = ["max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "seed", "top_k",
            "top_logprobs", "prompt_logprobs", "truncate_prompt_tokens"]
numbers = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "length_penalty"]
flags = ["add_generation_prompt", "continue_final_message", "add_special_tokens", "echo"]
messages = [{"role": "user", "content": "hi"}]
def line(url, body):
    return json.dumps({"custom_id": "a", "method": "POST", "url": url, "body": body}).encode()
base = {"model": "m", "messages": messages}
named = []
for url, body in [
    (CHAT, base | {k: "x" for k in integers}),
    (CHAT, base | {k: "x" for k in numbers}),
    (CHAT, base | {k: "x" for k in flags}),
    (COMPLETIONS, {"model": "m", "prompt": "hi", "logprobs": "x", "seed": "x", "top_k": "x"}),
]:
    named.append(validate_batch_input(line(url, body), url, limits).errors[0].param)
print(json.dumps(named))
"""


@pytest.mark.parametrize("hash_seed", ["0", "1", "2", "3"])
def test_a_line_with_several_bad_fields_names_the_same_one_in_every_process(
    hash_seed: str,
) -> None:
    """Which field a refusal names does not hang on the process's string hashing (the rules
    were sets): the API and the ingest process, or two replicas, name the same field."""
    limits = json.dumps(dataclasses.astuple(LIMITS)[:5])
    named = subprocess.run(
        [sys.executable, "-c", NAMES_FIRST_FAULT, limits],
        env=os.environ | {"PYTHONHASHSEED": hash_seed},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert json.loads(named) == [
        "body.max_tokens",
        "body.temperature",
        "body.add_generation_prompt",
        "body.seed",
    ]
