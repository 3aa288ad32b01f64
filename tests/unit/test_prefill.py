"""What a request prefills, counted as the engine renders it: every sequence, every field."""

from __future__ import annotations

from typing import Any

import pytest

from backfill.prefill import CHAT, COMPLETIONS, PromptCount, prefill_plan
from backfill.refusals import InvalidRequest
from backfill.request_fields import as_integer, normalise_fields

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_list_of_prompts_is_one_sequence_per_prompt() -> None:
    plan = prefill_plan(COMPLETIONS, {"prompt": ["a", "bb", "ccc"], "max_tokens": 4})
    assert plan.sequences == 3
    assert [b["prompt"] for b in plan.tokenize] == ["a", "bb", "ccc"]


def test_token_id_prompts_are_counted_without_the_engine() -> None:
    single = prefill_plan(COMPLETIONS, {"prompt": [5, 6, 7]})
    assert (single.tokenize, single.known, single.sequences) == ((), (3,), 1)
    several = prefill_plan(COMPLETIONS, {"prompt": [[1], [1, 2], [1, 2, 3, 4]]})
    assert (several.known, several.sequences) == ((1, 2, 4), 3)


def test_n_and_best_of_multiply_the_sequences() -> None:
    plan = prefill_plan(COMPLETIONS, {"prompt": ["a", "b"], "n": 2, "best_of": 3})
    assert plan.sequences == 6


def test_the_chat_count_carries_every_field_that_renders_into_the_prompt() -> None:
    body: dict[str, Any] = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "chat_template": "{{ messages }}",
        "chat_template_kwargs": {"custom": 1},
        "add_generation_prompt": False,
        "continue_final_message": True,
        "documents": [{"title": "t", "text": "x" * 1000}],
        "reasoning_effort": "high",
        "temperature": 0.5,
    }
    (tokenize,) = prefill_plan(CHAT, body).tokenize
    assert tokenize["messages"] is MESSAGES
    assert tokenize["tools"] == TOOLS
    assert tokenize["chat_template"] == "{{ messages }}"
    assert tokenize["add_generation_prompt"] is False
    assert tokenize["continue_final_message"] is True
    # /tokenize has no documents or reasoning_effort: they go in as template arguments,
    # over the caller's own, as vLLM's chat endpoint renders them.
    assert tokenize["chat_template_kwargs"] == {
        "custom": 1,
        "documents": body["documents"],
        "reasoning_effort": "high",
        "enable_thinking": True,
    }
    assert "temperature" not in tokenize


def test_a_plain_chat_is_counted_as_it_was_before() -> None:
    (tokenize,) = prefill_plan(CHAT, {"messages": MESSAGES}).tokenize
    assert tokenize == {"messages": MESSAGES}


@pytest.mark.parametrize(
    ("endpoint", "body"),
    [
        (COMPLETIONS, {"prompt": "x", "prompt_embeds": "AAAA"}),
        (COMPLETIONS, {"prompt": {"x": 1}}),
        (COMPLETIONS, {"prompt": []}),
        (COMPLETIONS, {"prompt": ["a", [1]]}),
        (CHAT, {"messages": []}),
        (CHAT, {"messages": MESSAGES, "chat_template_kwargs": [1]}),
        (CHAT, {"messages": MESSAGES, "n": 0}),
    ],
)
def test_what_cannot_be_counted_is_refused(endpoint: str, body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        prefill_plan(endpoint, body)


def test_a_count_charges_every_sequence_the_longest_prompt() -> None:
    count = PromptCount.of([10, 300, 20], 2)
    assert (count.longest, count.total, count.sequences) == (300, 330, 6)


def test_integral_numbers_are_stored_as_integers() -> None:
    body: dict[str, Any] = {"min_tokens": 3.0, "max_tokens": 10.0, "temperature": 1, "top_k": 2}
    assert normalise_fields(body, chat=True) is None
    assert body == {"min_tokens": 3, "max_tokens": 10, "temperature": 1, "top_k": 2}
    assert type(body["min_tokens"]) is int


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # vLLM reads "3.0" as 3, Backfill's resume read it with int() and crashed: numbers
        # written as strings are refused, as OpenAI's API refuses them.
        ({"min_tokens": "3.0"}, "min_tokens"),
        ({"seed": " 7 "}, "seed"),
        ({"temperature": "0.5"}, "temperature"),
        ({"min_tokens": 3.5}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),
        ({"temperature": [1]}, "temperature"),
        ({"add_generation_prompt": "false"}, "add_generation_prompt"),
        ({"logprobs": 1}, "logprobs"),
    ],
)
def test_numbers_and_flags_the_engine_would_misread_are_refused(
    body: dict[str, Any], param: str
) -> None:
    refused = normalise_fields(body, chat=True)
    assert refused is not None
    assert refused[0] == param


def test_a_stored_value_is_read_as_the_engine_reads_it() -> None:
    assert [as_integer(v) for v in ("3.0", " 7 ", 4.0, 5, "1e3", "x", True)] == [
        3,
        7,
        4,
        5,
        None,
        None,
        None,
    ]


def test_completions_logprobs_is_an_integer() -> None:
    body: dict[str, Any] = {"logprobs": 2.0}
    assert normalise_fields(body, chat=False) is None
    assert body == {"logprobs": 2}
